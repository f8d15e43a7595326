-- floodgate: read windows and period counters at `now` (state.lua); changes nothing, not even
-- an expiry, unlike an admission of cost 0, which writes what it read back.
return state_reply()
