-- floodgate: what windows and period counters hold at `now`, for an operator's read or reset
-- (state_read.lua, state_clear.lua); shared by both. Needs window_at (window.lua) and
-- period_at, total_in (period.lua).
-- KEYS: n windows, then the counters. ARGV[2]: n; ARGV[2 + j]: window j's W (µs);
-- ARGV[2 + n + i]: counter i's period, 'day' or 'month'.
-- Reply: {now, cur_1, prev_1, ..., cur_n, prev_n, total_1, ..., total_m}: each window's counts
-- rolled to `now` (Snapshot::at), each counter's total in its period at `now`.
local function state_reply()
  local reply = {now}
  local nk = #KEYS
  if nk == 0 then return reply end
  local n = tonumber(ARGV[2])
  local stored = redis.call('MGET', unpack(KEYS))
  for j = 1, n do
    local _, cur, prev = window_at(stored[j], tonumber(ARGV[2 + j]))
    reply[#reply + 1] = cur
    reply[#reply + 1] = prev
  end
  for i = n + 1, nk do
    reply[#reply + 1] = total_in(stored[i], (period_at(ARGV[2 + i])))
  end
  return reply
end
