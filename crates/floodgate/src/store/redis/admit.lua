-- floodgate: one step for a batch of requests: their budget reads, their chain admissions and
-- their charges after the fact, each request's admission one atomic step (Redis runs a script
-- to completion before any other command, so no two requests, in this batch or any other, can
-- take the same free slot). The requests are decided in order at one instant, exactly as if
-- each had been admitted alone: a request sees what the requests before it in the batch took.
-- Batching is how the store spends one script call, one MGET and one SET per key on many
-- requests that share keys (an org's, the gateway's) instead of on each; carrying a batch's
-- reads and charges in the same call spares them a call of their own (docs/redis.md,
-- "Batching").
--
-- KEYS: every distinct limit state the batch touches (nw windows), then every distinct period
-- counter (nc: a budget's spend in its period).
-- ARGV[1]: the time (clock.lua). ARGV[2]: the call's numbers, packed as one string of
-- little-endian doubles (exact for the integers sent, all below 2^53 but caps and units past it,
-- which compare and saturate as before), read into A (below): a call's arguments as strings cost
-- Redis an object each and the script a tonumber each, more than the arithmetic they feed.
-- ARGV[2 + j]: window j's TTL (ms, 2W) as digits, handed to SET as they are (a Lua number is
-- written by Redis 7.2.0-7.2.4 as `1e+08` when it is a multiple of 10^8, which PX refuses). A[1]:
-- nc; then per window j, A[a + 1..a + 3] with a = 1 + 3 * (j - 1): window W (µs), max, kind (1 for
-- a limit charged at admission, 2 for a reactive one, 3 and 4 for the same as shadow limits,
-- decided and charged as usual but never refusing); then per counter its period, 1 for a day, 2
-- for a month; then how many admission groups follow, and the admissions in the order they came,
-- in groups: a group is a run of requests of one cost on one chain: cost, count, n, g, the chain's
-- n key indices (into KEYS, in chain order), and last its gate's g pairs of a counter's index
-- (into KEYS) and a cap: the group is admitted only if each such counter is under its cap as the
-- call found it (a budget check in the same step; Store::admit_within). A batch of like requests
-- (many callers of one key) thus sends its chain once. A group whose requests cost each limit its
-- own units (a token estimate on a reserving token limit beside 1 on the request limits; chain.rs
-- Costs::PerLimit) sends a cost of -1 and, after its key indices, the n costs in chain order
-- (before the gate). Then, to the end, the charges in the order they came, applied after the
-- admissions: kind (1 tokens to windows, 2 an amount to counters), units, n, and its n key indices
-- (into KEYS).
-- State: windows "bucket cur prev"; counters "label total", a counter of an earlier period
-- starting again from 0, each kept until a day (period.rs GRACE) after its period ends. Every
-- comparison mirrors window.rs operation for operation, and the refusal chain.rs's
-- first_refusal: the first enforced limit that fails its test.
-- Reply: {now, cur_1, prev_1, ..., cur_nw, prev_nw, total_1, ..., total_nc, admitted_1, ...,
-- admitted_g}, packed as doubles (below): each window's counts and each counter's total at `now`
-- before the batch (what a budget read gets), and how many of each group's requests were admitted:
-- its first ones, since once one is refused nothing changes until the group ends. What each
-- request saw follows: a key's count plus the costs of the admitted requests before it that charge
-- that key; each charge's totals, the counters' totals plus the adds before it. (The client
-- replays those sums; a reply of every request's view of every limit cost the client more to parse
-- than the rest of the decision.)
--
-- Redis's Lua is slow next to this arithmetic (a tonumber, a table growing or a string.match
-- each cost about what a whole check does), so the script converts each argument once, sizes
-- its per-key tables once ({unpack(KEYS)}: one array of the right length) and decides a group
-- per key rather than per request (below).
local A
local nargs = #ARGV[2] / 8
if nargs <= 200 then
  -- The common call, unpacked at once (A's last value, past nargs, is unpack's position).
  A = {struct.unpack('<' .. string.rep('d', nargs), ARGV[2])}
else
  -- 200 at a time: unpack's values go on Lua's stack.
  A = {}
  local at = 1
  for i = 1, nargs, 200 do
    local m = math.min(200, nargs - i + 1)
    local v = {struct.unpack('<' .. string.rep('d', m), ARGV[2], at)}
    for k = 1, m do A[i + k - 1] = v[k] end
    at = v[m + 1]
  end
end
local nk = #KEYS
local nc = A[1]
local nw = nk - nc
local stored = {}
if nk > 0 then stored = redis.call('MGET', unpack(KEYS)) end
-- Per window: window, max, kind (as sent), its bucket, count, the previous window's count, and the
-- part of it still carried at `now` (prev * (W - elapsed), as Snapshot::admits has it). Per
-- counter: its period's label and end, and its total in that period.
local W, MAX, KIND, B, CUR, CARRIED = {unpack(KEYS)}, {unpack(KEYS)}, {unpack(KEYS)},
  {unpack(KEYS)}, {unpack(KEYS)}, {unpack(KEYS)}
local reply = {now}
for j = 1, nw do
  local a = 3 * j - 2
  local w = A[a + 1]
  local b, cur, prev = window_at(stored[j], w)
  W[j], MAX[j], KIND[j], B[j], CUR[j] = w, A[a + 2], A[a + 3], b, cur
  CARRIED[j] = prev * (w - (now - b * w))
  reply[2 * j] = cur
  reply[2 * j + 1] = prev
end
local pos = 2 + 3 * nw
local LABEL, ENDS, TOTAL = {}, {}, {}
for k = nw + 1, nk do
  if A[pos] == 1 then
    LABEL[k], ENDS[k] = period_at('day')
  else
    LABEL[k], ENDS[k] = period_at('month')
  end
  TOTAL[k] = total_in(stored[k], LABEL[k])
  reply[#reply + 1] = TOTAL[k]
  pos = pos + 1
end
local groups = A[pos]
pos = pos + 1
local dirty = {}
local chain = {}
-- A per-limit group's costs, in chain order.
local COST = {}
for _ = 1, groups do
  local cost, count, n, g = A[pos], A[pos + 1], A[pos + 2], A[pos + 3]
  pos = pos + 1
  local last = pos + 2 + n
  -- Per-limit costs follow the key indices; the chain of one cost (the common case) pays one
  -- comparison per key for them.
  local per = cost < 0
  if per then last = last + n end
  -- How many of the group's requests are admitted: the fewest that any key of its chain lets
  -- through. Request k (0-based) of the group sees a charged key at CUR + k * cost; the check
  -- (Snapshot::admits) only grows with k, so each key passes its first few requests and refuses
  -- the rest. A first guess from the real-valued bound is corrected with the exact check itself,
  -- so the answer is the one request-by-request checking gives.
  local admitted = count
  -- The group's gate: counters that must each be under its cap (a budget check in the same
  -- step), read as the call found them; a group stopped by one is refused whole.
  for i = 1, g do
    if TOTAL[A[last + 2 * i - 1]] >= A[last + 2 * i] then admitted = 0 end
  end
  last = last + 2 * g
  for i = 1, n do
    if admitted == 0 then break end
    local j = A[pos + 2 + i]
    chain[i] = j
    local w, carried, cur, max = W[j], CARRIED[j], CUR[j], MAX[j]
    local kind = KIND[j]
    local cost = cost
    if per then
      cost = A[pos + 2 + n + i]
      COST[i] = cost
    end
    local passes
    if kind == 2 then
      if (cur - max) * w + carried >= 0 then passes = 0 else passes = admitted end
    elseif kind ~= 1 then
      -- A shadow limit never refuses (chain.rs first_refusal); the client tells from the counts
      -- in the reply whether it was over.
      passes = admitted
    elseif cost == 0 then
      if (cur - max) * w + carried > 0 then passes = 0 else passes = admitted end
    else
      passes = math.floor((max - carried / w - cur) / cost)
      if not (passes > 0) then passes = 0 elseif passes > admitted then passes = admitted end
      -- passes: requests admitted; request `passes` (0-based) would see cur + passes * cost.
      while passes > 0 and (cur + (passes - 1) * cost + cost - max) * w + carried > 0 do
        passes = passes - 1
      end
      while passes < admitted and (cur + passes * cost + cost - max) * w + carried <= 0 do
        passes = passes + 1
      end
    end
    admitted = passes
    if admitted == 0 then break end
  end
  -- (Admitted ones mean the loop above ran over the whole chain.)
  if admitted > 0 then
    for i = 1, n do
      local j = chain[i]
      local kind = KIND[j]
      if kind == 1 or kind == 3 then
        local c = cost
        if per then c = COST[i] end
        -- Counts stop at 2^53 (window.rs MAX_COUNT): only a shadow limit, which admits past its
        -- max, can be charged that far.
        CUR[j] = math.min(CUR[j] + admitted * c, 9007199254740992)
        dirty[j] = true
      end
    end
  end
  pos = last + 1
  reply[#reply + 1] = admitted
end
-- The charges, after the admissions.
while pos <= nargs do
  local kind, units, n = A[pos], A[pos + 1], A[pos + 2]
  for i = 1, n do
    local j = A[pos + 2 + i]
    -- Counts and totals stop at 2^53 (window.rs MAX_COUNT, period.rs MAX_TOTAL): exact in a
    -- double, printable by %d.
    if kind == 1 then
      CUR[j] = math.min(CUR[j] + units, 9007199254740992)
    else
      TOTAL[j] = math.min(TOTAL[j] + units, 9007199254740992)
    end
    dirty[j] = true
  end
  pos = pos + 3 + n
end
for j = 1, nw do
  if dirty[j] then
    redis.call('SET', KEYS[j], string.format('%d %d %d', B[j], CUR[j], reply[2 * j + 1]), 'PX',
      ARGV[2 + j])
  end
end
for k = nw + 1, nk do
  if dirty[k] then
    redis.call('SET', KEYS[k], LABEL[k] .. ' ' .. string.format('%d', TOTAL[k]), 'PX',
      string.format('%d', math.ceil((ENDS[k] + DAY - now) / 1000)))
  end
end
-- The reply goes as one string of little-endian doubles, exact for these integers (all below
-- 2^53): the client reads one string for a fraction of what parsing an array of integers costs
-- it, about 1 500 instructions a value (docs/redis.md, "Batching"). Packed 64 at a time, since
-- unpack puts its values on Lua's stack.
local packed = {}
local n = #reply
for i = 1, n, 64 do
  local j = math.min(i + 63, n)
  packed[#packed + 1] = struct.pack('<' .. string.rep('d', j - i + 1), unpack(reply, i, j))
end
return table.concat(packed)
