-- floodgate: read period counters (budgets' spend) in their current periods; changes nothing.
-- KEYS: the counters. ARGV[1 + i]: counter i's period, 'day' or 'month'. State: "label total".
-- Reply: {now, total_1, ..., total_n}.
local stored = redis.call('MGET', unpack(KEYS))
local reply = {now}
for i = 1, #KEYS do
  local label = period_at(ARGV[1 + i])
  reply[i + 1] = total_in(stored[i], label)
end
return reply
