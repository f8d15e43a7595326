-- floodgate: add units to reactive limits (tokens of a finished response), one atomic step.
-- KEYS: the reactive limits' state. ARGV[2]: units; then per limit i, from a = 1 + 2 * i:
-- window W (µs) and the state's TTL (ms, 2W). State: "bucket cur prev", rolled by window.lua.
local units = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local a = 1 + 2 * i
  local w = tonumber(ARGV[a])
  local b, cur, prev = window_at(stored[i], w)
  -- Counts stop at 2^53 (window.rs MAX_COUNT): exact in a double, and printable by %d (a count
  -- past 2^63 would print negative and break the key).
  redis.call('SET', KEYS[i], string.format('%d %d %d', b, math.min(cur + units, 9007199254740992),
    prev), 'PX', ARGV[a + 1])
end
return 1
