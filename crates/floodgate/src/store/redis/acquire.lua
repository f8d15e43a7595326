-- floodgate: take tokens from a token bucket, one atomic step.
-- KEYS[1]: the bucket. ARGV[2..5]: capacity, rate tokens, rate period (µs), cost.
-- State: "tokens ts expires" (tokens with 17 significant digits, which round-trip every double;
-- ts and expires in µs on the deciding clock). State whose expiry has passed on that clock reads
-- as missing, as in the memory store; so does a value floodgate never writes (not in that form,
-- tokens not a number from 0 up, a time past 2^53), rather than failing the call
-- (docs/redis.md, "Keys and state"). Every operation mirrors bucket.rs in the same order.
-- Reply: {allowed, tokens left (as a string: Redis truncates numbers to integers), now}.
local cap = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local period = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local tokens = cap
-- When the state is written: now, or its own time if a clock ahead wrote it (bucket.rs,
-- BucketLimit::written_at): a clock behind refills nothing and moves no time back.
local at = now
local v = redis.call('GET', KEYS[1])
if v then
  local t, ts, expires = string.match(v, '^(%S+) (%d+) (%d+)$')
  t, ts, expires = tonumber(t), tonumber(ts), tonumber(expires)
  if t and t >= 0 and t < math.huge and ts <= 9007199254740992 and expires > now then
    local elapsed = now - ts
    if elapsed < 0 then
      elapsed = 0
      at = ts
    end
    tokens = math.min(cap, t + elapsed * rate / period)
  end
end
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
local missing = cap - tokens
if missing <= 0 then
  -- Full: a missing bucket reads as full, so nothing needs keeping.
  redis.call('DEL', KEYS[1])
else
  -- At most 2^52 µs (bucket.rs, MAX_TTL_MICROS): `now + ttl` must fit `%d` (an i64) and PX
  -- must print as an integer. PX goes as digits: Redis 7.2.0-7.2.4 write a Lua number that is a
  -- multiple of 10^8 as `1e+08`, which PX refuses.
  local ttl = math.min(math.ceil(missing * period / rate), 4503599627370496)
  redis.call('SET', KEYS[1], string.format('%.17g %d %d', tokens, at, at + ttl),
    'PX', string.format('%d', math.ceil((at + ttl - now) / 1000)))
end
return {allowed, string.format('%.17g', tokens), now}
