-- floodgate: calendar periods in UTC (period.rs), shared by the period counter scripts.
-- Dates from Unix time by Howard Hinnant's algorithms, as period.rs computes them; every
-- division is of non-negative integers, exact in doubles for any date before the year 285 000.
local DAY = 86400000000
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp
  if m > 2 then mp = m - 3 else mp = m + 9 end
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
-- The period of kind `kind` ('day' or 'month') containing `now`: its label (stored beside the
-- total: 2026-12-01 or 2026-12) and its end in µs.
local function period_at(kind)
  -- floor(now / DAY), corrected: the double division may round across an integer.
  local days = math.floor(now / DAY)
  if days * DAY > now then days = days - 1 elseif (days + 1) * DAY <= now then days = days + 1 end
  local y, m, d = civil_from_days(days)
  if kind == 'day' then
    return string.format('%04d-%02d-%02d', y, m, d), (days + 1) * DAY
  end
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return string.format('%04d-%02d', y, m), days_from_civil(ny, nm, 1) * DAY
end
-- A counter's total in the period `label` from its stored "label total" (false: none; so is a
-- value floodgate never writes, not in that form or with a total past 2^53, period.rs MAX_TOTAL,
-- which the reply could not carry: docs/redis.md, "Keys and state").
local function total_in(stored, label)
  if stored then
    local l, t = string.match(stored, '^(%S+) (%d+)$')
    t = tonumber(t)
    if l == label and t <= 9007199254740992 then return t end
  end
  return 0
end
