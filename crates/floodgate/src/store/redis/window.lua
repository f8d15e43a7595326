-- floodgate: a window's state seen at `now` (Snapshot::at in window.rs), shared by the window
-- scripts. `stored` is the key's "bucket cur prev" (false or nil: never written or expired);
-- returns the current bucket and its rolled counts: the same bucket as stored keeps (cur, prev),
-- the next one reads (0, cur), any later one (0, 0), an earlier one (a clock behind the one that
-- wrote it) (cur + prev, 0). A value floodgate never writes (not in that form, or a count past
-- 2^53, window.rs MAX_COUNT) reads as never written: an error here would fail the whole call,
-- every request of its batch (docs/redis.md, "Keys and state").
local function window_at(stored, w)
  -- floor(now / w), corrected: the double division may round across an integer.
  local b = math.floor(now / w)
  if b * w > now then b = b - 1 elseif (b + 1) * w <= now then b = b + 1 end
  local cur, prev = 0, 0
  local sb, sc, sp
  if stored then
    sb, sc, sp = string.match(stored, '^(%d+) (%d+) (%d+)$')
    sb, sc, sp = tonumber(sb), tonumber(sc), tonumber(sp)
  end
  if sb and sc <= 9007199254740992 and sp <= 9007199254740992 then
    if sb == b then
      cur, prev = sc, sp
    elseif sb + 1 == b then
      prev = sc
    elseif sb > b then
      -- Written by a clock ahead of this one: all its units count now (Snapshot::at).
      cur = math.min(sc + sp, 9007199254740992)
    end
  end
  return b, cur, prev
end
