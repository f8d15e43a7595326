-- floodgate: each slot set's live members (admit_holding.lua) at `now`, changing nothing: an
-- operator's read. KEYS: the slot sets. Reply: one count per key.
local reply = {}
for j = 1, #KEYS do
  reply[j] = redis.call('ZCOUNT', KEYS[j], '(' .. string.format('%d', now), '+inf')
end
return reply
