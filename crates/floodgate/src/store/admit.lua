-- floodgate: chain admission for a batch of requests, each one atomic step (Redis runs a script
-- to completion before any other command, so no two requests, in this batch or any other, can
-- take the same free slot). The requests are decided in order at one instant, exactly as if
-- each had been admitted alone: a request sees what the requests before it in the batch took.
-- Batching is how the store spends one script call, one MGET and one SET per key on many
-- requests that share keys (an org's, the gateway's) instead of on each.
--
-- KEYS: every distinct limit state the batch touches.
-- ARGV[1]: the time (clock.lua); then per key j, ARGV[a + 1..a + 4] with a = 1 + 4 * (j - 1):
-- window W (µs), max,
-- 'a' for a limit charged at admission or 'r' for a reactive one, the state's TTL (ms, 2W);
-- then the requests in the order they came, in groups: a group is a run of requests of one cost
-- on one chain: cost, count, n, and the chain's n key indices (into KEYS, in chain order). A
-- batch of like requests (many callers of one key) thus sends its chain once: each argument
-- costs Redis a string and the script a tonumber.
-- State: "bucket cur prev". Every comparison mirrors window.rs operation for operation.
-- Reply: {now, cur_1, prev_1, ..., cur_k, prev_k, admitted_1, ..., admitted_g}: each key's counts
-- at `now` before the batch, and how many of each group's requests were admitted: its first
-- ones, since once one is refused nothing changes until the group ends. What each request saw
-- follows: a key's count plus the costs of the admitted requests before it that charge that
-- key. (The client replays that sum; a reply of every request's view of every limit cost the
-- client more to parse than the rest of the decision.)
local nk = #KEYS
local stored = {}
if nk > 0 then stored = redis.call('MGET', unpack(KEYS)) end
local W, MAX, CHARGED, TTL, B, E, CUR, PREV = {}, {}, {}, {}, {}, {}, {}, {}
for j = 1, nk do
  local a = 1 + 4 * (j - 1)
  local w = tonumber(ARGV[a + 1])
  local b, cur, prev = window_at(stored[j], w)
  W[j], MAX[j], CHARGED[j], TTL[j] = w, tonumber(ARGV[a + 2]), ARGV[a + 3] == 'a', ARGV[a + 4]
  B[j], E[j], CUR[j], PREV[j] = b, now - b * w, cur, prev
end
local reply = {now}
for j = 1, nk do
  reply[2 * j] = CUR[j]
  reply[2 * j + 1] = PREV[j]
end
local dirty = {}
local pos = 2 + 4 * nk
local nargs = #ARGV
while pos <= nargs do
  local cost, count, n = tonumber(ARGV[pos]), tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2])
  local chain = {}
  for i = 1, n do
    chain[i] = tonumber(ARGV[pos + 2 + i])
  end
  pos = pos + 3 + n
  local admitted = 0
  while admitted < count do
    local ok = true
    for i = 1, n do
      local j = chain[i]
      local w = W[j]
      -- Snapshot::admits: the same four IEEE operations in the same order.
      local carried = PREV[j] * (w - E[j])
      if CHARGED[j] then
        ok = (CUR[j] + cost - MAX[j]) * w + carried <= 0
      else
        ok = (CUR[j] - MAX[j]) * w + carried < 0
      end
      if not ok then break end
    end
    if not ok then break end
    admitted = admitted + 1
    for i = 1, n do
      local j = chain[i]
      if CHARGED[j] then
        CUR[j] = CUR[j] + cost
        dirty[j] = true
      end
    end
  end
  reply[#reply + 1] = admitted
end
for j = 1, nk do
  if dirty[j] then
    redis.call('SET', KEYS[j], string.format('%d %d %d', B[j], CUR[j], PREV[j]), 'PX', TTL[j])
  end
end
return reply
