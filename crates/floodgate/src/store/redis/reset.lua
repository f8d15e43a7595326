-- floodgate: delete a token bucket, saying whether it had been used (was not full at now).
-- KEYS[1]: the bucket. ARGV[2..4]: capacity, rate tokens, rate period (µs). State as acquire.lua,
-- a value it reads as missing included: deleted, never used.
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
redis.call('DEL', KEYS[1])
local t, ts, expires = string.match(v, '^(%S+) (%d+) (%d+)$')
t, ts, expires = tonumber(t), tonumber(ts), tonumber(expires)
if not (t and t >= 0 and t < math.huge and ts <= 9007199254740992 and expires > now) then
  return 0
end
local cap = tonumber(ARGV[2])
local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
local tokens = math.min(cap, t + elapsed * tonumber(ARGV[3]) / tonumber(ARGV[4]))
if tokens < cap then return 1 end
return 0
