-- floodgate: give back a lease's slots (admit_holding.lua). KEYS: the slot sets; ARGV[2]: the
-- lease's member. A member already gone (expired, or given back before) changes nothing; the
-- last member's removal deletes the set.
for j = 1, #KEYS do
  redis.call('ZREM', KEYS[j], ARGV[2])
end
return #KEYS
