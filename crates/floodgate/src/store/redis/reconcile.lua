-- floodgate: reconcile token reservations (window.rs Snapshot::reconciled), one atomic step:
-- a response's actual tokens minus what its admission reserved, added to (or, negative, taken
-- from) the bucket the reservation was charged to, never below zero. Never replayed by the
-- client: run twice it would count twice.
-- KEYS: the reserving limits' state. ARGV[2]: delta (signed); then per limit i, from
-- a = 1 + 3 * i: window W (µs), the reservation's bucket, and the state's TTL (ms, 2W).
-- State: "bucket cur prev", rolled by window.lua. The reservation's bucket is the current one
-- (or ahead of it: a clock ahead decided it) or the previous one; one older no longer counts: a
-- refund into it is dropped, units owed go into the current bucket (towards stricter).
-- A refund lowers a count: whatever caches a refusal of these keys must drop it
-- (docs/design.md, "Token reservation").
local delta = tonumber(ARGV[2])
local stored = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local a = 3 * i
  local w, reserved = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local b, cur, prev = window_at(stored[i], w)
  local ncur, nprev = cur, prev
  -- Counts stay within 0 and 2^53 (window.rs MAX_COUNT), as saturating_add_signed keeps them.
  local function add(count) return math.max(0, math.min(count + delta, 9007199254740992)) end
  if reserved >= b then
    ncur = add(cur)
  elseif reserved + 1 == b then
    nprev = add(prev)
  elseif delta > 0 then
    ncur = add(cur)
  end
  if ncur ~= cur or nprev ~= prev then
    redis.call('SET', KEYS[i], string.format('%d %d %d', b, ncur, nprev), 'PX', ARGV[a + 2])
  end
end
return 1
