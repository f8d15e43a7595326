//! A JSON object's top level read without building it (docs/design.md §6): each member's key and
//! the raw bytes of its value, found by skipping values over their quotes and brackets. Metering
//! reads two or three fields of every response; a full parse of the rest (the choices, the
//! message) cost more than everything else it does.
//!
//! What this reader skips it does not validate: a value is skipped by its brackets and quotes,
//! and a member's value is only as well-formed as the parse its caller makes of it. Where it
//! cannot tell what a full parse would make of a member (a key with an escape in it), it says so
//! ([`Unreadable`]), and the caller parses the whole body instead.

/// A member of an object's top level.
pub(super) struct Member<'a> {
    /// The key's bytes between its quotes, as written (escapes not undone: see `escaped`).
    pub(super) key: &'a [u8],
    /// Whether the key has an escape (`\`), so that `key` is not its text.
    pub(super) escaped: bool,
    /// The value's bytes, from its first to its last (a string with its quotes).
    pub(super) value: &'a [u8],
}

/// The reader met something it does not take apart: not an object, or broken framing.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Unreadable;

/// The members of the object `buf` holds, in order, each an `Err(Unreadable)` where the reader
/// gives up (then it yields nothing more). Bytes after the object are not looked at.
pub(super) fn members(buf: &[u8]) -> Members<'_> {
    Members {
        buf,
        at: 0,
        state: State::Start,
    }
}

/// The iterator of [`members`].
pub(super) struct Members<'a> {
    buf: &'a [u8],
    at: usize,
    state: State,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the opening brace.
    Start,
    /// After the brace or a member: a member, a comma or the closing brace next.
    Inside { first: bool },
    /// The object closed, or the reader gave up.
    Done,
}

impl<'a> Iterator for Members<'a> {
    type Item = Result<Member<'a>, Unreadable>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.step();
        match &item {
            Some(Ok(_)) => {}
            _ => self.state = State::Done,
        }
        item
    }
}

impl<'a> Members<'a> {
    fn step(&mut self) -> Option<Result<Member<'a>, Unreadable>> {
        let buf = self.buf;
        let first = match self.state {
            State::Done => return None,
            State::Start => {
                let i = skip_space(buf, 0);
                if buf.get(i) != Some(&b'{') {
                    return Some(Err(Unreadable));
                }
                self.at = i + 1;
                true
            }
            State::Inside { first } => first,
        };
        let mut i = skip_space(buf, self.at);
        match buf.get(i) {
            Some(b'}') => return None,
            Some(b',') if !first => i = skip_space(buf, i + 1),
            Some(b'"') if first => {}
            _ => return Some(Err(Unreadable)),
        }
        if buf.get(i) != Some(&b'"') {
            return Some(Err(Unreadable));
        }
        let Some((key_end, escaped)) = string_end(buf, i) else {
            return Some(Err(Unreadable));
        };
        let key = &buf[i + 1..key_end - 1];
        let colon = skip_space(buf, key_end);
        if buf.get(colon) != Some(&b':') {
            return Some(Err(Unreadable));
        }
        let start = skip_space(buf, colon + 1);
        let Some(end) = value_end(buf, start) else {
            return Some(Err(Unreadable));
        };
        self.at = end;
        self.state = State::Inside { first: false };
        Some(Ok(Member {
            key,
            escaped,
            value: &buf[start..end],
        }))
    }
}

/// The first index from `i` on that is not JSON whitespace (`buf.len()` if none).
pub(super) fn skip_space(buf: &[u8], mut i: usize) -> usize {
    while buf
        .get(i)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
    {
        i += 1;
    }
    i
}

/// The end (exclusive, after the closing quote) of the string whose opening quote is at
/// `buf[open]`, and whether it has an escape; `None` if it does not end.
#[inline]
pub(super) fn string_end(buf: &[u8], open: usize) -> Option<(usize, bool)> {
    let (mut i, mut escaped) = (open + 1, false);
    // Eight bytes at a time at first: the strings of a response are mostly a few bytes long,
    // shorter than what a vectorised search pays for its setup. One still open after those (a
    // message's content, thousands of bytes) is searched for its quotes and escapes.
    let short = i + SHORT_STRING;
    while i < short {
        i = match word_at(buf, i) {
            Some(w) => match first_flagged(bytes_equal(w, b'"') | bytes_equal(w, b'\\')) {
                Some(at) => i + at,
                None => {
                    i += WORD;
                    continue;
                }
            },
            // The last few bytes of the buffer: one by one.
            None => {
                i + buf
                    .get(i..)?
                    .iter()
                    .position(|b| matches!(b, b'"' | b'\\'))?
            }
        };
        if buf[i] == b'"' {
            return Some((i + 1, escaped));
        }
        escaped = true;
        i += 2;
    }
    long_string_end(buf, i, escaped)
}

/// The rest of [`string_end`] for a long string, from `i` on: out of line, so that the short
/// strings' loop stays small where it is inlined.
#[inline(never)]
fn long_string_end(buf: &[u8], mut i: usize, mut escaped: bool) -> Option<(usize, bool)> {
    loop {
        let at = i + memchr::memchr2(b'"', b'\\', buf.get(i..)?)?;
        if buf[at] == b'"' {
            return Some((at + 1, escaped));
        }
        escaped = true;
        i = at + 2;
    }
}

/// How many bytes of a string [`string_end`] reads a word at a time before it searches.
const SHORT_STRING: usize = 24;

/// The bytes of a word, the unit of the scans below: eight bytes compared at once in a `u64`
/// (docs/design.md §6). The reader's values are mostly shorter than a vectorised search's
/// setup is worth, and longer than a byte-by-byte loop is quick for.
const WORD: usize = 8;

/// The eight bytes at `buf[i..]` as a little-endian word (the first byte lowest), if there are
/// eight.
#[inline]
fn word_at(buf: &[u8], i: usize) -> Option<u64> {
    let bytes: [u8; WORD] = buf.get(i..i.checked_add(WORD)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// One in every byte of a word.
const ONES: u64 = u64::from_le_bytes([0x01; WORD]);
/// The high bit of every byte of a word.
const HIGHS: u64 = u64::from_le_bytes([0x80; WORD]);

/// The high bit set of each byte of `w` that equals `b`: exact up to and including the first
/// such byte; bytes after it may be flagged falsely (a borrow), so only the lowest flag is read.
#[inline]
fn bytes_equal(w: u64, b: u8) -> u64 {
    let x = w ^ (ONES * u64::from(b));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// The index of the byte of the lowest flag in `flags` (from [`bytes_equal`]), if any. Flags
/// of several searches may be or-ed: the lowest of them is exact in each.
#[inline]
fn first_flagged(flags: u64) -> Option<usize> {
    (flags != 0).then(|| flags.trailing_zeros() as usize / 8)
}

/// What a byte is to [`value_end`]'s scan of a container.
const PLAIN: u8 = 0;
const QUOTE: u8 = 1;
const OPEN: u8 = 2;
const CLOSE: u8 = 3;

/// Each byte's [`PLAIN`], [`QUOTE`], [`OPEN`] or [`CLOSE`].
static CLASS: [u8; 256] = {
    let mut class = [PLAIN; 256];
    class[b'"' as usize] = QUOTE;
    class[b'{' as usize] = OPEN;
    class[b'[' as usize] = OPEN;
    class[b'}' as usize] = CLOSE;
    class[b']' as usize] = CLOSE;
    class
};

/// The first byte from `i` on that is not [`PLAIN`], a word at a time while there are eight.
#[inline]
fn next_structural(buf: &[u8], mut i: usize) -> Option<usize> {
    // `{` and `[` differ in one bit (0x20), as do `}` and `]`: with it cleared, a bracket of
    // either kind is found by one comparison.
    const FOLD: u64 = !u64::from_le_bytes([0x20; WORD]);
    while let Some(w) = word_at(buf, i) {
        let folded = w & FOLD;
        let flags = bytes_equal(w, b'"') | bytes_equal(folded, b'[') | bytes_equal(folded, b']');
        match first_flagged(flags) {
            Some(at) => return Some(i + at),
            None => i += WORD,
        }
    }
    Some(
        i + buf
            .get(i..)?
            .iter()
            .position(|&b| CLASS[usize::from(b)] != PLAIN)?,
    )
}

/// The end (exclusive) of the value starting at `buf[start]`; `None` if it does not end (or
/// there is none).
pub(super) fn value_end(buf: &[u8], start: usize) -> Option<usize> {
    match *buf.get(start)? {
        b'"' => string_end(buf, start).map(|(end, _)| end),
        b'{' | b'[' => {
            let (mut i, mut depth) = (start + 1, 1usize);
            loop {
                i = next_structural(buf, i)?;
                match CLASS[usize::from(buf[i])] {
                    QUOTE => i = string_end(buf, i)?.0,
                    OPEN => {
                        depth += 1;
                        i += 1;
                    }
                    _ => {
                        depth -= 1;
                        i += 1;
                        if depth == 0 {
                            return Some(i);
                        }
                    }
                }
            }
        }
        // A number, `true`, `false` or `null`: to the next delimiter.
        _ => {
            let len = buf[start..]
                .iter()
                .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n'))
                .unwrap_or(buf.len() - start);
            (len > 0).then_some(start + len)
        }
    }
}

/// A string value without escapes (its text between the quotes) or `null`; `None` for anything
/// else.
pub(super) fn plain_string(raw: &[u8]) -> Option<Option<&str>> {
    if raw == b"null" {
        return Some(None);
    }
    let text = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    if text.contains(&b'\\') {
        return None;
    }
    // Control characters are not allowed unescaped in a JSON string: the full parse decides.
    if text.iter().any(|&b| b < 0x20) {
        return None;
    }
    std::str::from_utf8(text).ok().map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(buf: &[u8]) -> Result<Vec<(String, String)>, Unreadable> {
        members(buf)
            .map(|m| {
                m.map(|m| {
                    (
                        String::from_utf8_lossy(m.key).into_owned(),
                        String::from_utf8_lossy(m.value).into_owned(),
                    )
                })
            })
            .collect()
    }

    #[test]
    fn members_with_their_raw_values() {
        let body = br#" { "id" : "a\"b}" , "n":-1.5e3,"o":{"x":[1,{"y":"]"}]},"a":[],"t":true,"z":null } trailing"#;
        let got = read(body).unwrap();
        let want = [
            ("id", r#""a\"b}""#),
            ("n", "-1.5e3"),
            ("o", r#"{"x":[1,{"y":"]"}]}"#),
            ("a", "[]"),
            ("t", "true"),
            ("z", "null"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        assert_eq!(read(b"{}").unwrap(), vec![]);
        assert_eq!(read(b"\n{ }").unwrap(), vec![]);
    }

    #[test]
    fn strings_end_at_their_first_unescaped_quote_however_long() {
        // Around the length read byte by byte, and far past it; escapes (a quote among them) on
        // either side of it and at its edge.
        for len in [
            0,
            1,
            5,
            SHORT_STRING - 2,
            SHORT_STRING - 1,
            SHORT_STRING,
            SHORT_STRING + 1,
            4000,
        ] {
            for escape_at in [
                None,
                Some(0),
                Some(len / 2),
                Some(SHORT_STRING - 1),
                Some(len),
            ] {
                // An escaped quote, or an escaped backslash (the quote after it ends the string).
                for escape in ["\\\"", "\\\\"] {
                    let mut text = "x".repeat(len);
                    if let Some(at) = escape_at.filter(|&at| at <= len) {
                        text.insert_str(at, escape);
                    }
                    let buf = format!("\"{text}\",\"next\"");
                    let want = 1 + text.len() + 1;
                    assert_eq!(
                        string_end(buf.as_bytes(), 0),
                        Some((want, text.contains('\\'))),
                        "{len} {escape_at:?} {escape}"
                    );
                    // Cut before its closing quote, it does not end.
                    assert_eq!(string_end(&buf.as_bytes()[..want - 1], 0), None);
                }
            }
        }
        // An escape as the last byte: no end.
        assert_eq!(string_end(br#""abc\"#, 0), None);
        let long = format!("\"{}\\", "y".repeat(100));
        assert_eq!(string_end(long.as_bytes(), 0), None);
    }

    /// [`value_end`] as a byte-by-byte reader would find it: what the word-at-a-time scans must
    /// agree with.
    fn value_end_byte_by_byte(buf: &[u8], start: usize) -> Option<usize> {
        let (mut i, mut depth, mut in_string) = (start, 0usize, false);
        loop {
            let b = *buf.get(i)?;
            i += 1;
            if in_string {
                match b {
                    b'\\' => i += 1,
                    b'"' => {
                        in_string = false;
                        if depth == 0 {
                            return Some(i);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(i);
                    }
                }
                _ => {}
            }
        }
    }

    #[test]
    fn words_find_what_bytes_find_at_every_offset() {
        // Each structural byte (and look-alikes a bit away from one: `;` `{`+1, `\x7b`-`\x20`
        // is `[`, `\xa2` is `"` with the high bit) at every offset of a container and of a
        // string, past the first word and in the last few bytes, which are read one by one.
        let specials: [&[u8]; 10] = [
            b"\"",
            b"\\\"",
            b"\\\\",
            b"{}",
            b"[]",
            b"{\"a\":[1]}",
            b";",
            b"\xa2",
            b"\xfb",
            b"|",
        ];
        for len in 0..40 {
            for at in 0..=len {
                for special in specials {
                    let mut text = vec![b'x'; len];
                    text.splice(at..at, special.iter().copied());
                    // Inside a string (a structural byte there is text; a quote needs its
                    // escape to stay inside), and inside an array, quoted where it is a string.
                    let quoted: Vec<u8> = text
                        .iter()
                        .flat_map(|&b| {
                            if b == b'"' {
                                vec![b'\\', b'"']
                            } else {
                                vec![b]
                            }
                        })
                        .collect();
                    for buf in [
                        [&b"\""[..], &quoted, b"\",1"].concat(),
                        [&b"["[..], &text, b"],1"].concat(),
                        [&b"[\""[..], &quoted, b"\"],1"].concat(),
                    ] {
                        assert_eq!(
                            value_end(&buf, 0),
                            value_end_byte_by_byte(&buf, 0),
                            "{:?}",
                            String::from_utf8_lossy(&buf)
                        );
                        for cut in 0..buf.len() {
                            assert_eq!(
                                value_end(&buf[..cut], 0),
                                value_end_byte_by_byte(&buf[..cut], 0),
                                "{:?}",
                                String::from_utf8_lossy(&buf[..cut])
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_escaped_key_is_flagged() {
        let m: Vec<_> = members(br#"{"us\u0061ge":1,"plain":2}"#)
            .map(Result::unwrap)
            .collect();
        assert!(m[0].escaped);
        assert!(!m[1].escaped);
    }

    #[test]
    fn broken_framing_is_unreadable_and_ends_the_members() {
        for broken in [
            &b"[1]"[..],
            b"not json",
            b"",
            br#"{"a":1"#,
            br#"{"a" 1}"#,
            br#"{"a":}"#,
            br#"{"a":"open}"#,
            br#"{"a":[1,2}"#,
            br#"{"a":1 "b":2}"#,
            br#"{,"a":1}"#,
            br#"{"a":1,}"#,
        ] {
            let items: Vec<_> = members(broken).collect();
            assert!(
                items.last().is_some_and(Result::is_err),
                "{:?}",
                String::from_utf8_lossy(broken)
            );
            assert_eq!(items.iter().filter(|m| m.is_err()).count(), 1);
        }
    }
}
