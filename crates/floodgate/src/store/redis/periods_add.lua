-- floodgate: add an amount to period counters (a response's spend to every budget), one atomic
-- step. Never replayed by the client: run twice it would charge twice.
-- KEYS: the counters. ARGV[2]: the amount; ARGV[2 + i]: counter i's period, 'day' or 'month'.
-- State: "label total"; a counter last written in an earlier period starts again from 0. Each
-- key lives until a day (period.rs GRACE) after its period ends, on the deciding clock.
-- Reply: {now, total_1, ..., total_n} after the add.
local amount = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
local reply = {now}
for i = 1, #KEYS do
  local label, period_end = period_at(ARGV[2 + i])
  -- Totals stop at 2^53 (period.rs MAX_TOTAL): exact in a double, printable by %d.
  local total = math.min(total_in(stored[i], label) + amount, 9007199254740992)
  redis.call('SET', KEYS[i], label .. ' ' .. string.format('%d', total), 'PX',
    math.ceil((period_end + DAY - now) / 1000))
  reply[i + 1] = total
end
return reply
