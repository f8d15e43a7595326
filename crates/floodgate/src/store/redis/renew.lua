-- floodgate: renew leases still running (admit_holding.lua): each member's expiry moves to
-- now + the lease time. KEYS[j]: a slot set; ARGV[2]: the lease time (µs); ARGV[2 + j]: the
-- member held in KEYS[j]. XX: a member that is gone (an admission found it expired and removed
-- it, so its slot may be someone else's now) is not brought back.
local lease = tonumber(ARGV[2])
local ms = math.ceil(lease / 1000)
for j = 1, #KEYS do
  redis.call('ZADD', KEYS[j], 'XX', now + lease, ARGV[2 + j])
  if redis.call('PTTL', KEYS[j]) < ms then
    redis.call('PEXPIRE', KEYS[j], string.format('%d', ms))
  end
end
return #KEYS
