-- floodgate: the decision instant, shared by every script (prepended to each).
-- ARGV[1] is the caller's time in microseconds (a pinned clock, or clock = client), or empty to
-- read the server's TIME, so that replicas with skewed clocks still share one clock.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  -- Before Redis 5 a script that read TIME could not write unless it replicated its effects
  -- instead of itself; from Redis 7 this is the only mode and the call is a no-op.
  if redis.replicate_commands then redis.replicate_commands() end
else
  now = tonumber(ARGV[1])
end
