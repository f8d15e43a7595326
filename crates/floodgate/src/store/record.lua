-- floodgate: add units to reactive limits (tokens of a finished response), one atomic step.
-- KEYS: the reactive limits' state. ARGV[2]: units; then per limit i, from a = 1 + 2 * i:
-- window W (µs) and the state's TTL (ms, 2W). State: "bucket cur prev", rolled as in admit.lua.
local units = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local a = 1 + 2 * i
  local w = tonumber(ARGV[a])
  local b = math.floor(now / w)
  if b * w > now then b = b - 1 elseif (b + 1) * w <= now then b = b + 1 end
  local cur, prev = 0, 0
  local v = stored[i]
  if v then
    local sb, sc, sp = string.match(v, '^(%d+) (%d+) (%d+)$')
    sb = tonumber(sb)
    if sb == b then
      cur, prev = tonumber(sc), tonumber(sp)
    elseif sb + 1 == b then
      prev = tonumber(sc)
    end
  end
  redis.call('SET', KEYS[i], string.format('%d %d %d', b, cur + units, prev), 'PX', ARGV[a + 1])
end
return 1
