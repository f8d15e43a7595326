-- floodgate: add units to reactive limits (tokens of a finished response), one atomic step.
-- KEYS: the reactive limits' state. ARGV[2]: units; then per limit i, from a = 1 + 2 * i:
-- window W (µs) and the state's TTL (ms, 2W). State: "bucket cur prev", rolled by window.lua.
local units = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local a = 1 + 2 * i
  local w = tonumber(ARGV[a])
  local b, cur, prev = window_at(stored[i], w)
  redis.call('SET', KEYS[i], string.format('%d %d %d', b, cur + units, prev), 'PX', ARGV[a + 1])
end
return 1
