-- floodgate: a batch of charges after the fact, in the order they came, one atomic step: tokens
-- of finished responses to reactive limits (record.lua's operation) and spend to period counters
-- (periods_add.lua's). Never replayed by the client: run twice it would charge twice. Batching
-- is how a busy store reads and writes an org's token window and budget once for many responses
-- instead of once each.
--
-- KEYS: the batch's distinct window states, then its distinct period counters.
-- ARGV[1]: the time (clock.lua); ARGV[2]: how many KEYS are windows (nw); then per window j its
-- window W (µs) and TTL (ms, 2W); then per counter its period, 'day' or 'month'; then the
-- charges in order, each: kind ('r' tokens to windows, 'p' an amount to counters), units, n,
-- and its n key indices (into KEYS).
-- State: windows "bucket cur prev", rolled by window.lua; counters "label total", a counter of
-- an earlier period starting again from 0, each kept until a day (period.rs GRACE) after its
-- period ends.
-- Reply: {now, total_1, ..., total_m}: each counter's total in its period at `now`, before the
-- batch. (The client replays the adds in order for each charge's totals after it.)
local nk = #KEYS
local nw = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
local TTL, B, CUR, PREV, LABEL, ENDS, TOTAL = {}, {}, {}, {}, {}, {}, {}
local reply = {now}
local pos = 3
for j = 1, nw do
  B[j], CUR[j], PREV[j] = window_at(stored[j], tonumber(ARGV[pos]))
  TTL[j] = ARGV[pos + 1]
  pos = pos + 2
end
for k = nw + 1, nk do
  LABEL[k], ENDS[k] = period_at(ARGV[pos])
  TOTAL[k] = total_in(stored[k], LABEL[k])
  reply[k - nw + 1] = TOTAL[k]
  pos = pos + 1
end
local dirty = {}
local nargs = #ARGV
while pos <= nargs do
  local kind, units, n = ARGV[pos], tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2])
  for i = 1, n do
    local j = tonumber(ARGV[pos + 2 + i])
    -- Counts and totals stop at 2^53 (window.rs MAX_COUNT, period.rs MAX_TOTAL): exact in a
    -- double, printable by %d.
    if kind == 'r' then
      CUR[j] = math.min(CUR[j] + units, 9007199254740992)
    else
      TOTAL[j] = math.min(TOTAL[j] + units, 9007199254740992)
    end
    dirty[j] = true
  end
  pos = pos + 3 + n
end
for j = 1, nw do
  if dirty[j] then
    redis.call('SET', KEYS[j], string.format('%d %d %d', B[j], CUR[j], PREV[j]), 'PX', TTL[j])
  end
end
for k = nw + 1, nk do
  if dirty[k] then
    redis.call('SET', KEYS[k], LABEL[k] .. ' ' .. string.format('%d', TOTAL[k]), 'PX',
      math.ceil((ENDS[k] + DAY - now) / 1000))
  end
end
return reply
