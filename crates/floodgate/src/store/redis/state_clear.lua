-- floodgate: an operator's reset: what windows and period counters hold at `now` (state.lua),
-- then deleted, in one step, so that what is answered is what went. A delete is idempotent:
-- the client replays it once, like a read.
local reply = state_reply()
if #KEYS > 0 then redis.call('DEL', unpack(KEYS)) end
return reply
