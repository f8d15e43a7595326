-- floodgate: one chain admission that also takes a slot in each of the chain's concurrency
-- limits (in_flight.rs), all in one atomic step: admitted only if every enforced window limit
-- passes (as admit.lua decides a request alone) and every enforced concurrency limit has a free
-- slot; then the window limits charged at admission are charged and a slot is taken in each
-- concurrency limit; a refusal changes nothing but the removal of expired slots.
--
-- A slot is a member of a sorted set scored by its expiry (µs, on the scripts' clock): the
-- holding process renews it (renew.lua) while its request runs, and releases it (release.lua)
-- when done; a member past its expiry belongs to a process that died, and is removed here.
--
-- KEYS: the chain's n window states, then its m slot sets.
-- ARGV[1]: the time (clock.lua); ARGV[2]: n; ARGV[3]: the lease's member; ARGV[4]: the lease
-- time (µs); then per window key i, ARGV[a + 1..a + 5] with a = 4 + 5 * (i - 1): window W (µs),
-- max, kind ('a' charged at admission, 'r' reactive, 's' appended for a shadow limit: 'as',
-- 'rs'), TTL (ms), and the limit's cost (its own: chain.rs Costs); then per slot set j, ARGV[b + 1..b + 2] with b = 4 + 5 * n + 2 * (j - 1): max,
-- kind ('c', or 'cs' for a shadow limit, which takes a slot but never refuses).
-- A replayed call (its reply lost with its connection: scripts.rs) finds its lease in every
-- slot set, which only an admission adds it to: it answers admitted and charges nothing again.
-- Reply: {now, cur_1, prev_1, ..., cur_n, prev_n, running_1, ..., running_m, admitted}: each
-- window's counts at `now` before the charge, each slot set's members other than this lease
-- (live ones), and 1 or 0.
local n = tonumber(ARGV[2])
local member, lease = ARGV[3], tonumber(ARGV[4])
local m = #KEYS - n
local reply = {now}
local admitted = true
local stored = {}
if n > 0 then stored = redis.call('MGET', unpack(KEYS, 1, n)) end
local B, CUR, PREV, COST = {}, {}, {}, {}
for i = 1, n do
  local a = 4 + 5 * (i - 1)
  local w, max, kind = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3]
  local cost = tonumber(ARGV[a + 5])
  COST[i] = cost
  local b, cur, prev = window_at(stored[i], w)
  B[i], CUR[i], PREV[i] = b, cur, prev
  reply[2 * i] = cur
  reply[2 * i + 1] = prev
  -- Snapshot::admits, as admit.lua has it; shadow kinds never refuse.
  local carried = prev * (w - (now - b * w))
  if kind == 'a' then
    if (cur + cost - max) * w + carried > 0 then admitted = false end
  elseif kind == 'r' then
    if (cur - max) * w + carried >= 0 then admitted = false end
  end
end
-- A member is only ever added by an admission: finding this lease's in every set means this
-- call is a replay of one that already admitted (its reply lost with its connection).
local replayed = m > 0
for j = 1, m do
  local key = KEYS[n + j]
  local b = 4 + 5 * n + 2 * (j - 1)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local running = redis.call('ZCARD', key)
  -- A replayed call finds its own lease: it is not counted against itself.
  if redis.call('ZSCORE', key, member) then running = running - 1 else replayed = false end
  reply[#reply + 1] = running
  if ARGV[b + 2] == 'c' and running >= tonumber(ARGV[b + 1]) then admitted = false end
end
if replayed then
  -- Admitted and charged already: answer so again, with the counts the first call saw, and
  -- charge nothing twice (the slots' expiries are renewed below, as a renewal would).
  admitted = true
  for i = 1, n do
    local kind = ARGV[4 + 5 * (i - 1) + 3]
    if kind == 'a' or kind == 'as' then
      reply[2 * i] = math.max(0, CUR[i] - COST[i])
    end
  end
end
if admitted then
  for i = 1, replayed and 0 or n do
    local a = 4 + 5 * (i - 1)
    local kind = ARGV[a + 3]
    if kind == 'a' or kind == 'as' then
      local cur = math.min(CUR[i] + COST[i], 9007199254740992)
      redis.call('SET', KEYS[i], string.format('%d %d %d', B[i], cur, PREV[i]), 'PX', ARGV[a + 4])
    end
  end
  -- The set outlives its newest member; each member's own expiry is its score.
  local ms = string.format('%d', math.ceil(lease / 1000))
  for j = 1, m do
    redis.call('ZADD', KEYS[n + j], now + lease, member)
    -- Only ever lengthened: a replica with a shorter lease must not cut another's live slots.
    if redis.call('PTTL', KEYS[n + j]) < tonumber(ms) then
      redis.call('PEXPIRE', KEYS[n + j], ms)
    end
  end
  reply[#reply + 1] = 1
else
  reply[#reply + 1] = 0
end
return reply
