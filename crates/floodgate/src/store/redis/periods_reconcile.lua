-- floodgate: reconcile a reservation on period counters (a budget's reserved spend), period.rs
-- PeriodState::reconciled, one atomic step. Never replayed by the client: run twice it would
-- count twice.
-- KEYS: the counters. ARGV[2]: delta (signed: actual minus reserved); ARGV[3]: the reservation's
-- instant (µs); ARGV[3 + i]: counter i's period, 'day' or 'month'.
-- Into the reservation's period, never below zero; if that period has ended, a refund is
-- dropped and an amount owed goes into the current period (towards stricter). A refund lowers a
-- total: whatever caches a refusal must drop it (docs/design.md §11).
local delta, reserved_at = tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local kind = ARGV[3 + i]
  local label, period_end = period_at(kind)
  -- The reservation's period: period_at reads `now`, so it is asked at that instant.
  local at = now
  now = reserved_at
  local reserved_label = period_at(kind)
  now = at
  if delta > 0 or reserved_label == label then
    local total = total_in(stored[i], label)
    local adjusted = math.max(0, math.min(total + delta, 9007199254740992))
    if adjusted ~= total then
      redis.call('SET', KEYS[i], label .. ' ' .. string.format('%d', adjusted), 'PX',
        string.format('%d', math.ceil((period_end + DAY - now) / 1000)))
    end
  end
end
return 1
