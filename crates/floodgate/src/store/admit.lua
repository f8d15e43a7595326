-- floodgate: chain admission, one atomic step (Redis runs a script to completion before any
-- other command, so no two requests can take the same free slot).
-- KEYS: each limit's state, in chain order.
-- ARGV[2]: cost; then per limit i, from a = 3 + 4 * (i - 1): window W (µs), max, 'a' for a
-- limit charged at admission or 'r' for a reactive one, and the state's TTL (ms, 2W).
-- State: "bucket cur prev". Every comparison mirrors window.rs operation for operation.
-- Reply: {now, admitted, cur_1, prev_1, ...}: each limit's counts before any charge.
local cost = tonumber(ARGV[2])
local n = #KEYS
local stored = {}
if n > 0 then stored = redis.call('MGET', unpack(KEYS)) end
local reply = {now, 0}
local buckets, curs, prevs = {}, {}, {}
local admitted = true
for i = 1, n do
  local a = 3 + 4 * (i - 1)
  local w = tonumber(ARGV[a])
  -- floor(now / w), corrected: the double division may round across an integer.
  local b = math.floor(now / w)
  if b * w > now then b = b - 1 elseif (b + 1) * w <= now then b = b + 1 end
  local e = now - b * w
  local cur, prev = 0, 0
  local v = stored[i]
  if v then
    local sb, sc, sp = string.match(v, '^(%d+) (%d+) (%d+)$')
    sb = tonumber(sb)
    if sb == b then
      cur, prev = tonumber(sc), tonumber(sp)
    elseif sb + 1 == b then
      prev = tonumber(sc)
    end
  end
  if admitted then
    -- Snapshot::admits: the same four IEEE operations in the same order.
    local max = tonumber(ARGV[a + 1])
    local carried = prev * (w - e)
    if ARGV[a + 2] == 'a' then
      admitted = (cur + cost - max) * w + carried <= 0
    else
      admitted = (cur - max) * w + carried < 0
    end
  end
  buckets[i], curs[i], prevs[i] = b, cur, prev
  reply[2 * i + 1] = cur
  reply[2 * i + 2] = prev
end
if admitted then
  reply[2] = 1
  for i = 1, n do
    local a = 3 + 4 * (i - 1)
    if ARGV[a + 2] == 'a' then
      redis.call('SET', KEYS[i], string.format('%d %d %d', buckets[i], curs[i] + cost, prevs[i]),
        'PX', ARGV[a + 3])
    end
  end
end
return reply
