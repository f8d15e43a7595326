//! The log's format: `tracing-subscriber`'s default, with the request line written by hand
//! (docs/design.md §8).
//!
//! Every answer writes a request line (`access_log`), so on a gateway at the default level
//! (`info`) its formatting is on every request's path. The default formatter spends some 12k
//! instructions on it (a metered request's whole work is about 65k: docs/benchmarks.md), most of
//! them in `core::fmt` machinery: the timestamp's seven numbers, each field's name painted in a
//! style that writes nothing without colours, each value through a formatter. [`Lines`] writes
//! that line's bytes directly, the same bytes the default formatter writes (a test holds the two
//! to that), and leaves every other line, and every line on a terminal (in colour), to the
//! default.

use std::any::TypeId;
use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Writer};
use tracing_subscriber::fmt::time::SystemTime as DefaultTimer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::access_log;

/// The gateway's event format: the default (`Full`, timestamps in UTC to the microsecond), the
/// request line written without `core::fmt` where it can be.
#[derive(Debug)]
pub struct Lines {
    full: Format<Full, DefaultTimer>,
    now: fn() -> SystemTime,
}

impl Default for Lines {
    fn default() -> Lines {
        Lines {
            full: Format::default(),
            now: SystemTime::now,
        }
    }
}

impl Lines {
    /// The format, reading the time from `now` for the lines it writes itself (tests hold it
    /// still).
    pub fn with_clock(now: fn() -> SystemTime) -> Lines {
        Lines {
            now,
            ..Lines::default()
        }
    }
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        // Any other line, colours, another way of formatting fields, spans around the line (the
        // gateway opens none) and a clock outside years 1970 to 9999 are the default's.
        let ours = is_request_line(meta)
            && !writer.has_ansi_escapes()
            && TypeId::of::<N>() == TypeId::of::<DefaultFields>()
            && ctx.event_scope().is_none();
        // The clock is read for our lines only: the default reads its own.
        let since = match ours.then(|| (self.now)().duration_since(UNIX_EPOCH)) {
            Some(Ok(since)) if since.as_secs() < YEAR_10000 => since,
            _ => return self.full.format_event(ctx, writer, event),
        };
        write_timestamp(&mut writer, since)?;
        writer.write_str(level(*meta.level()))?;
        writer.write_char(' ')?;
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        let mut fields = Fields {
            sanitize: writer.sanitizes_ansi_escapes(),
            writer: &mut writer,
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_char('\n')
    }
}

/// The first second of the year 10000, which the default timer writes as `+10000`.
const YEAR_10000: u64 = 253_402_300_800;

/// The fields of the request line (`access_log::write`), whose types [`Fields`] writes as the
/// default format does (a test holds it to that).
const REQUEST_LINE: [&str; 8] = [
    "key",
    "method",
    "path",
    "status",
    "latency_ms",
    "decision",
    "tokens",
    "message",
];

/// Whether `meta` is the request line's: its target and its fields, none other.
fn is_request_line(meta: &Metadata<'_>) -> bool {
    let fields = meta.fields();
    meta.target() == access_log::TARGET
        && fields.len() == REQUEST_LINE.len()
        && fields.iter().all(|f| REQUEST_LINE.contains(&f.name()))
}

/// A level as the default format writes it: five characters wide.
fn level(level: Level) -> &'static str {
    match level {
        Level::TRACE => "TRACE",
        Level::DEBUG => "DEBUG",
        Level::INFO => " INFO",
        Level::WARN => " WARN",
        Level::ERROR => "ERROR",
    }
}

/// An event's fields as the default format writes them without colours: `name=value` apart by
/// spaces, the message bare, a string quoted and escaped as `{:?}` does, a number in decimal.
struct Fields<'a, 'w> {
    writer: &'a mut Writer<'w>,
    /// Whether the message's terminal control characters are escaped, as the default format
    /// escapes them when the writer says so.
    sanitize: bool,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_, '_> {
    /// Starts a field: the space before it (not before the first) and its name (a raw
    /// identifier's without its `r#`), or nothing for the message.
    fn name(&mut self, field: &Field) -> fmt::Result {
        if !std::mem::replace(&mut self.first, false) {
            self.writer.write_char(' ')?;
        }
        match field.name() {
            "message" => Ok(()),
            name => {
                self.writer
                    .write_str(name.strip_prefix("r#").unwrap_or(name))?;
                self.writer.write_char('=')
            }
        }
    }

    fn record(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_ok() {
            self.result = self.name(field).and_then(|()| value(self.writer));
        }
    }
}

impl Visit for Fields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let sanitize = self.sanitize;
            return self.record(field, |w| match sanitize {
                true => Escaping(w).write_str(value),
                false => w.write_str(value),
            });
        }
        // `{:?}` leaves printable ASCII but the quote and the backslash as it is.
        let plain = value
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\');
        self.record(field, |w| {
            if plain {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            } else {
                write!(w, "{value:?}")
            }
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.record(field, |w| match thousandths(value) {
            Some(n) => write_thousandths(w, n),
            None => write!(w, "{value:?}"),
        });
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.record(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let sanitize = self.sanitize && field.name() == "message";
        self.record(field, |w| match sanitize {
            true => write!(Escaping(w), "{value:?}"),
            false => write!(w, "{value:?}"),
        });
    }
}

/// Writes through to a writer with the terminal's control characters escaped, as the default
/// format escapes a message's: ESC, BEL, BS, FF and DEL as `\x1b` and so on, C1 controls as
/// `\u{80}` to `\u{9f}`.
struct Escaping<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut plain = 0;
        for (at, c) in s.char_indices() {
            let escaped = match c {
                '\x1b' => "\\x1b",
                '\x07' => "\\x07",
                '\x08' => "\\x08",
                '\x0c' => "\\x0c",
                '\x7f' => "\\x7f",
                '\u{80}'..='\u{9f}' => "",
                _ => continue,
            };
            self.0.write_str(&s[plain..at])?;
            if escaped.is_empty() {
                write!(self.0, "\\u{{{:x}}}", c as u32)?;
            } else {
                self.0.write_str(escaped)?;
            }
            plain = at + c.len_utf8();
        }
        self.0.write_str(&s[plain..])
    }
}

/// `value` as a count of thousandths, if it is one exactly as a division by a thousand gives
/// it (a latency's microseconds in milliseconds) and small enough that its decimal is the
/// shortest that reads back as it: what `{:?}` writes.
fn thousandths(value: f64) -> Option<u64> {
    // Fifteen digits of thousandths: exact as a float, and no shorter decimal is the same
    // float (31 years as milliseconds).
    const BELOW: f64 = 1e12;
    if !(0.0..BELOW).contains(&value) || value.is_sign_negative() {
        return None;
    }
    // In range and not negative: the cast neither wraps nor saturates.
    let n = (value * 1e3).round() as u64;
    (n as f64 / 1e3 == value).then_some(n)
}

/// Writes `n` thousandths as `{:?}` writes `n as f64 / 1e3`: `12.345`, `0.006`, `3.0`.
fn write_thousandths(w: &mut Writer<'_>, n: u64) -> fmt::Result {
    w.write_str(itoa::Buffer::new().format(n / 1_000))?;
    w.write_char('.')?;
    let frac = n % 1_000;
    if frac == 0 {
        return w.write_char('0');
    }
    let digits = [
        b'0' + (frac / 100) as u8,
        b'0' + (frac / 10 % 10) as u8,
        b'0' + (frac % 10) as u8,
    ];
    // Trailing zeros are not written.
    let len = 3 - usize::from(frac.is_multiple_of(10)) - usize::from(frac.is_multiple_of(100));
    w.write_str(std::str::from_utf8(&digits[..len]).map_err(|_| fmt::Error)?)
}

thread_local! {
    /// The second last written and its text, `YYYY-MM-DDTHH:MM:SS.`: a busy thread writes many
    /// lines a second, and only the microseconds change between them.
    static SECOND: Cell<(u64, [u8; 20])> = const { Cell::new((u64::MAX, [0; 20])) };
}

/// Writes `since`, a time after the epoch, as the default timer does
/// (`2026-12-07T14:50:00.123456Z`, UTC), and a space.
fn write_timestamp(w: &mut Writer<'_>, since: Duration) -> fmt::Result {
    let secs = since.as_secs();
    let (cached, mut text) = SECOND.get();
    if cached != secs {
        text = second_text(secs);
        SECOND.set((secs, text));
    }
    let mut micros = since.subsec_micros();
    let mut tail = *b"000000Z ";
    for digit in tail[..6].iter_mut().rev() {
        *digit = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    // Both are ASCII digits and punctuation.
    w.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)?;
    w.write_str(std::str::from_utf8(&tail).map_err(|_| fmt::Error)?)
}

/// `YYYY-MM-DDTHH:MM:SS.` for `secs` after the epoch (UTC, the proleptic Gregorian calendar;
/// years past 9999 are not written by a clock of this age).
fn second_text(secs: u64) -> [u8; 20] {
    let days = secs / 86_400;
    let in_day = secs % 86_400;
    let (year, month, day) = floodgate::period::civil_from_days(days);
    let mut out = *b"0000-00-00T00:00:00.";
    let mut put = |at: usize, width: usize, mut n: u64| {
        for digit in out[at..at + width].iter_mut().rev() {
            *digit = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    put(0, 4, year);
    put(5, 2, month);
    put(8, 2, day);
    put(11, 2, in_day / 3_600);
    put(14, 2, in_day / 60 % 60);
    put(17, 2, in_day % 60);
    out
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use axum::http::{Method, StatusCode};
    use floodgate::ScopeKind;

    use super::*;
    use crate::access_log::Decision;

    /// What a subscriber writes, line by line.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn lines(&self) -> Vec<String> {
            let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
            text.lines().map(str::to_owned).collect()
        }
    }

    /// The lines `events` writes through the default format and through [`Lines`] (its clock
    /// at 2026-12-07T14:50:00.012345Z).
    fn both(events: impl Fn()) -> (Vec<String>, Vec<String>) {
        let (default, ours) = (Captured::default(), Captured::default());
        let writer = default.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, &events);
        let writer = ours.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .event_format(Lines::with_clock(|| {
                UNIX_EPOCH + Duration::new(1_796_655_000, 12_345_678)
            }))
            .finish();
        tracing::subscriber::with_default(subscriber, &events);
        (default.lines(), ours.lines())
    }

    #[test]
    fn the_request_line_is_the_default_formats_byte_for_byte() {
        let (default, ours) = both(|| {
            let start = Instant::now();
            let write = |key, path, decision, tokens| {
                crate::access_log::write(
                    key,
                    &Method::POST,
                    path,
                    StatusCode::OK,
                    start,
                    decision,
                    tokens,
                );
            };
            write(
                Some("k"),
                "/v1/chat/completions",
                Decision::Admitted,
                Some(10),
            );
            write(None, "/v1/models", Decision::Unauthenticated, None);
            write(
                Some("team-a.key_1"),
                "/v1/a\"b\\c\u{7f}\té/ü",
                Decision::Refused(ScopeKind::BusinessUnit),
                Some(u64::MAX),
            );
            write(Some("k"), "", Decision::BadRequest, Some(0));
            // Any other line is the default's own.
            tracing::warn!(error = %"boom", n = 3, "something else");
        });
        assert_eq!(default.len(), 5);
        assert_eq!(ours.len(), 5);
        for (d, o) in default.iter().zip(&ours) {
            // Written at another time: the lines agree after their timestamps.
            // Its latency is measured again (the float's text is tested below).
            let (d_time, d_rest) = d.split_once(' ').unwrap();
            let (o_time, o_rest) = o.split_once(' ').unwrap();
            assert_eq!(without_latency(o_rest), without_latency(d_rest));
            assert_eq!(d_time.len(), "2026-12-07T14:50:00.012345Z".len(), "{d}");
            if o_rest.contains("access_log") {
                assert_eq!(o_time, "2026-12-07T14:50:00.012345Z");
            }
        }
        assert_eq!(
            without_latency(&ours[0]),
            "2026-12-07T14:50:00.012345Z  INFO floodgate_gateway::access_log: request key=k \
             method=POST path=\"/v1/chat/completions\" status=200 latency_ms=_ \
             decision=\"admitted\" tokens=10"
        );
    }

    fn without_latency(line: &str) -> String {
        match line.split_once("latency_ms=") {
            Some((before, after)) => {
                let rest = after.split_once(' ').map_or("", |(_, r)| r);
                format!("{before}latency_ms=_ {rest}")
            }
            None => line.to_owned(),
        }
    }

    /// A request line (the request line's fields, whatever their values) with `latency_ms` at
    /// `value` and the message `message`.
    macro_rules! request_line {
        ($latency:expr, $($message:tt)+) => {
            tracing::info!(
                target: "floodgate_gateway::access_log",
                key = %"k",
                method = %"GET",
                path = "/",
                status = 200u16,
                latency_ms = $latency,
                decision = "admitted",
                tokens = Some(1u64),
                $($message)+
            )
        };
    }

    /// What [`Lines`] writes of a request line's float.
    fn float_text(value: f64) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .event_format(Lines::with_clock(|| UNIX_EPOCH))
            .finish();
        tracing::subscriber::with_default(subscriber, || request_line!(value, "request"));
        let line = out.lines().remove(0);
        assert!(
            line.starts_with("1970-01-01T00:00:00.000000Z"),
            "not ours: {line}"
        );
        let after = line.split_once("latency_ms=").unwrap().1;
        after.split_once(' ').unwrap().0.to_owned()
    }

    #[test]
    fn other_lines_of_the_target_and_odd_messages_are_the_defaults() {
        let (default, ours) = both(|| {
            // The request line's fields with messages that need escaping, a `-0.0`.
            request_line!(1.5, "a\x1bb\x07c\u{9b}d\x7fé");
            request_line!(-0.0, "{} and {:?}", "x\x1b", "y\x08");
            // The target, other fields.
            tracing::info!(target: "floodgate_gateway::access_log", key = "k", "request");
            tracing::info!(target: "floodgate_gateway::access_log", r#type = 3, "r#");
        });
        assert_eq!(default.len(), 4);
        for (d, o) in default.iter().zip(&ours) {
            assert_eq!(o.split_once(' ').unwrap().1, d.split_once(' ').unwrap().1);
        }
        assert!(ours[0].starts_with("2026-12-07T14:50:00.012345Z"), "ours");
        assert!(ours[0].contains(r"a\x1bb\x07c\u{9b}d\x7fé"), "{}", ours[0]);
        assert!(
            !ours[2].starts_with("2026-12-07T14:50:00.012345Z"),
            "the default's"
        );
        // Past year 9999, the default's own timestamp.
        let far = Captured::default();
        let writer = far.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .event_format(Lines::with_clock(|| {
                UNIX_EPOCH + Duration::from_secs(YEAR_10000)
            }))
            .finish();
        tracing::subscriber::with_default(subscriber, || request_line!(1.0, "request"));
        // (The default reads the real clock; ours would have written the year as `0000`.)
        assert!(far.lines()[0].starts_with("20"), "{}", far.lines()[0]);
    }

    #[test]
    fn a_latency_is_written_as_debug_writes_the_float() {
        let mut cases: Vec<u64> = (0..5_000).collect();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            // xorshift: latencies of every size up to years, in microseconds.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            cases.push(x % 10u64.pow(1 + (x % 15) as u32));
            cases.push(999_999_999_999_999 - x % 1_000);
        }
        for micros in cases {
            let ms = micros as f64 / 1e3;
            assert_eq!(thousandths(ms), Some(micros), "{micros}");
            let mut text = String::new();
            write_thousandths(&mut Writer::new(&mut text), micros).unwrap();
            assert_eq!(text, format!("{ms:?}"), "{micros}");
        }
        for v in [0.0, 0.006, 1.0, 12.345, 100.1, 999_999.999, 1e11 + 0.5] {
            assert_eq!(float_text(v), format!("{v:?}"), "{v}");
        }
        // Not thousandths, negative, huge or not a number: `{:?}` itself.
        for v in [
            0.0001,
            -1.0,
            1e12,
            1e14 + 0.5,
            1e300,
            f64::NAN,
            f64::INFINITY,
            0.1 + 0.2,
        ] {
            assert_eq!(thousandths(v), None, "{v}");
            assert_eq!(float_text(v), format!("{v:?}"), "{v}");
        }
    }

    #[test]
    fn the_microseconds_are_zero_padded_and_the_second_follows_the_clock() {
        let line = |now: fn() -> SystemTime| {
            let out = Captured::default();
            let writer = out.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .event_format(Lines::with_clock(now))
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                crate::access_log::write(
                    None,
                    &Method::GET,
                    "/",
                    StatusCode::OK,
                    Instant::now(),
                    Decision::Admitted,
                    None,
                );
            });
            out.lines()[0].split_once(' ').unwrap().0.to_owned()
        };
        assert_eq!(
            line(|| UNIX_EPOCH + Duration::new(1_796_655_000, 999)),
            "2026-12-07T14:50:00.000000Z"
        );
        // The thread's cached second is replaced when the clock moves on.
        assert_eq!(
            line(|| UNIX_EPOCH + Duration::new(1_796_655_001, 999_999_999)),
            "2026-12-07T14:50:01.999999Z"
        );
        assert_eq!(
            line(|| UNIX_EPOCH + Duration::new(0, 0)),
            "1970-01-01T00:00:00.000000Z"
        );
    }

    #[test]
    fn a_second_is_written_as_the_default_timer_writes_it() {
        assert_eq!(&second_text(0), b"1970-01-01T00:00:00.");
        assert_eq!(&second_text(1_796_655_000), b"2026-12-07T14:50:00.");
        assert_eq!(&second_text(951_782_399), b"2000-02-28T23:59:59.");
        assert_eq!(&second_text(951_868_800), b"2000-03-01T00:00:00.");
        assert_eq!(&second_text(4_107_542_400), b"2100-03-01T00:00:00.");
    }
}
