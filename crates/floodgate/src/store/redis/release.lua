-- floodgate: give back leases' slots (admit_holding.lua), a batch of releases in one call.
-- KEYS: the distinct slot sets of the batch. ARGV[2..]: each release as its lease's member, n,
-- and the n indices (into KEYS) of its slot sets. A member already gone (expired, or given back
-- before) changes nothing; the last member's removal deletes the set. Idempotent, so replayed
-- once like a read.
local pos = 2
local nargs = #ARGV
local removed = 0
while pos <= nargs do
  local member, n = ARGV[pos], tonumber(ARGV[pos + 1])
  for i = 1, n do
    removed = removed + redis.call('ZREM', KEYS[tonumber(ARGV[pos + 1 + i])], member)
  end
  pos = pos + 2 + n
end
return removed
