//! Request paths as a lenient upstream reads them: which name a completion or a Responses
//! create, which make the upstream generate (and so are charged their usage), and which carry a
//! dot segment.

use axum::http::Method;

/// Whether a request path names a completion endpoint (`.../completions`), as a lenient
/// upstream may read it: percent-escapes decoded (`/v1/chat/completion%73`), once or twice
/// (`/v1/chat/completion%2573`), in any case
/// (`/v1/chat/Completions`), with trailing slashes (`/v1/chat/completions/`) or empty segments,
/// with backslashes for slashes (as the dot-segment check takes them), and with path
/// parameters (`/v1/chat/completions;v=1`: servlet containers and some routers drop a
/// segment's `;...`). A path taken for a completion that is not one only has its body
/// checked.
pub fn is_completion_path(path: &str) -> bool {
    known(path).map_or_else(|| reads_as_completion(path), |k| k.completion)
}

/// [`is_completion_path`] for a path [`KNOWN`] does not list: segment by segment.
fn reads_as_completion(path: &str) -> bool {
    with_segments(path, |s| {
        s.next_back()
            .is_some_and(|l| l.eq_ignore_ascii_case(b"completions"))
    })
}

/// Whether a request path names the Responses API's create endpoint (`.../responses`), read as
/// [`is_completion_path`] reads a path.
pub fn is_responses_path(path: &str) -> bool {
    known(path).map_or_else(|| reads_as_responses(path), |k| k.responses)
}

/// [`is_responses_path`] for a path [`KNOWN`] does not list: segment by segment.
fn reads_as_responses(path: &str) -> bool {
    with_segments(path, |s| {
        s.next_back()
            .is_some_and(|l| l.eq_ignore_ascii_case(b"responses"))
    })
}

/// Whether the usage in the answer to this request is charged: a `POST`, except one that acts
/// on a stored object. Such answers carry the usage of work done, and charged, before: a stored
/// response, chat completion, run or batch fetched (`GET /v1/responses/{id}`, also as a resumed
/// stream), cancelled (`POST /v1/responses/{id}/cancel`, any `.../cancel`) or updated
/// (`POST /v1/chat/completions/{id}`, `POST /v1/threads/{t}/runs/{r}`: a segment after
/// `completions`, `responses`, `runs` or `batches` names a stored one). Charging those would
/// charge the same tokens at every fetch. Every other `POST` is charged the usage its answer
/// carries (chat completions, responses, embeddings, audio, images, streamed runs and their
/// `submit_tool_outputs`, a response's `compact`, other APIs an upstream serves).
pub fn is_generating_request(method: &Method, path: &str) -> bool {
    method == Method::POST
        && known(path).map_or_else(|| reads_as_generating(path), |k| k.generating)
}

/// Whether a `POST` to `path` starts work whose tokens no answer through the gateway will carry:
/// a Realtime session held outside the gateway (an ephemeral key minted for a client,
/// `.../realtime/client_secrets`, `.../realtime/sessions`, `.../realtime/transcription_sessions`;
/// a WebRTC call, `.../realtime/calls` or a `POST` of an SDP offer to `.../realtime`), a batch
/// (`.../batches`), a fine-tuning job (`.../fine_tuning/jobs`) or an eval run
/// (`.../evals/{id}/runs`). Their answers come at once and the work is done, and billed, later.
/// Read as [`is_completion_path`] reads a path: any reading of it that names one counts.
pub fn defers_generation(path: &str) -> bool {
    known(path).map_or_else(|| reads_as_deferred(path), |k| k.deferred)
}

/// [`defers_generation`] for a path [`KNOWN`] does not list: segment by segment.
fn reads_as_deferred(path: &str) -> bool {
    with_segments(path, |s| {
        let is = |segment: Option<&[u8]>, name: &[u8]| {
            segment.is_some_and(|g| g.eq_ignore_ascii_case(name))
        };
        let (last, before) = (s.next_back(), s.next_back());
        const REALTIME: [&[u8]; 4] = [
            b"client_secrets",
            b"sessions",
            b"transcription_sessions",
            b"calls",
        ];
        is(last, b"realtime")
            || (is(before, b"realtime") && REALTIME.iter().any(|n| is(last, n)))
            || is(last, b"batches")
            || (is(last, b"jobs") && is(before, b"fine_tuning"))
            || (is(last, b"runs") && is(s.next_back(), b"evals"))
    })
}

/// Whether a `POST` to `path` makes the upstream generate ([`is_generating_request`]), for a
/// path [`KNOWN`] does not list: segment by segment.
fn reads_as_generating(path: &str) -> bool {
    const STORED: [&[u8]; 4] = [b"completions", b"responses", b"runs", b"batches"];
    // The creates themselves, however the path starts (read as `is_completion_path` reads it,
    // so a body rewritten to ask for usage always has its answer read), and the actions on a
    // stored one that make the upstream generate: a run's tool outputs, a response's
    // compaction.
    const GENERATE: [&[u8]; 4] = [
        b"completions",
        b"responses",
        b"submit_tool_outputs",
        b"compact",
    ];
    let named =
        |segment: &[u8], names: &[&[u8]]| names.iter().any(|n| segment.eq_ignore_ascii_case(n));
    with_segments(path, |s| {
        let Some(last) = s.next_back() else {
            return true;
        };
        if named(last, &GENERATE) {
            return true;
        }
        if named(last, &[b"cancel"]) {
            return false;
        }
        // A segment after a stored collection's name names a stored one.
        for segment in &mut *s {
            if named(segment, &STORED) {
                return false;
            }
        }
        true
    })
}

/// How a path reads: what [`is_completion_path`], [`is_responses_path`] and (for a `POST`)
/// [`is_generating_request`] say of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reading {
    completion: bool,
    responses: bool,
    generating: bool,
    deferred: bool,
}

/// The paths nearly every metered request names, spelled as the API documents them, with how
/// they read: told by one comparison each instead of split into segments, on a path every
/// metered request takes (docs/design.md §6, "Which requests are read"). Every other spelling
/// is read segment by segment; a test proves each reading here is the one that gives.
const KNOWN: [(&str, Reading); 4] = [
    (
        "/v1/chat/completions",
        Reading {
            completion: true,
            responses: false,
            generating: true,
            deferred: false,
        },
    ),
    (
        "/v1/responses",
        Reading {
            completion: false,
            responses: true,
            generating: true,
            deferred: false,
        },
    ),
    (
        "/v1/completions",
        Reading {
            completion: true,
            responses: false,
            generating: true,
            deferred: false,
        },
    ),
    (
        "/v1/embeddings",
        Reading {
            completion: false,
            responses: false,
            generating: true,
            deferred: false,
        },
    ),
];

/// How `path` reads, if it is one of the [`KNOWN`] paths as spelled there.
fn known(path: &str) -> Option<Reading> {
    KNOWN.iter().find(|(p, _)| *p == path).map(|&(_, r)| r)
}

/// `f` of the path's non-empty segments, read as a lenient upstream may read them (see
/// [`is_completion_path`]): percent-escapes decoded, `\\` taken for `/`, each segment's `;`
/// parameters dropped. `false` for a path that does not start with `/`. A path with escapes
/// left after one decoding is read decoded twice as well, as the dot-segment check reads it
/// (an upstream, or a proxy in front of it, may decode again: `/v1/chat/completion%2573`), and
/// `f` holds if it holds of either reading: every caller's `true` is the stricter answer (the
/// body read, the usage charged). Nothing is allocated for a path without percent-escapes.
fn with_segments(
    path: &str,
    f: impl Fn(&mut dyn DoubleEndedIterator<Item = &[u8]>) -> bool,
) -> bool {
    let reads = |decoded: &[u8]| {
        let mut segments = decoded
            .split(|&b| b == b'/' || b == b'\\')
            .map(|segment| segment.split(|&b| b == b';').next().unwrap_or_default())
            .filter(|segment| !segment.is_empty());
        decoded.starts_with(b"/") && f(&mut segments)
    };
    let once = percent_decoded(path.as_bytes());
    reads(&once) || (once.contains(&b'%') && reads(&percent_decoded(&once)))
}

/// `raw` with its percent-escapes decoded (once; a `%` not followed by two hex digits is kept);
/// borrowed when it has none.
pub fn percent_decoded(raw: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !raw.contains(&b'%') {
        return std::borrow::Cow::Borrowed(raw);
    }
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            raw[i],
            raw.get(i + 1).copied().and_then(hex),
            raw.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                decoded.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, ..) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    std::borrow::Cow::Owned(decoded)
}

/// Whether `path` has a `.` or `..` segment, percent-encoded or not (`/v1/%2e%2e/admin`).
pub fn has_dot_segment(path: &str) -> bool {
    let raw = path.as_bytes();
    if !raw.contains(&b'.') && !raw.contains(&b'%') {
        return false;
    }
    // Decoded twice (`%252e`), split on either slash (`..%2f`, `..\`), each segment cut at a
    // path parameter (`..;/`): the ways servers and proxies in front of them have resolved
    // dot segments that a plain check would not see.
    let once = percent_decoded(raw);
    let twice = percent_decoded(&once);
    twice.split(|&b| b == b'/' || b == b'\\').any(|segment| {
        let segment = segment.split(|&b| b == b';').next().unwrap_or_default();
        segment == b"." || segment == b".."
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_done_later_is_told_from_work_answered_now() {
        for path in [
            "/v1/realtime",
            "/v1/realtime/client_secrets",
            "/v1/realtime/sessions",
            "/v1/realtime/transcription_sessions",
            "/v1/realtime/calls",
            "/v1/batches",
            "/v1/batches/",
            "/openai/v1/batches",
            "/v1/fine_tuning/jobs",
            "/v1/evals/eval_1/runs",
            "/v1/REALTIME/Calls;x=1",
            "/v1/realtime%2Fsessions",
        ] {
            assert!(defers_generation(path), "{path}");
        }
        for path in [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/threads/t/runs",
            "/v1/batches/b/cancel",
            "/v1/realtime/calls/c/hangup",
            "/v1/fine_tuning/jobs/j/cancel",
            "/v1/evals/eval_1",
            "/v1/sessions",
            "/v1/jobs",
        ] {
            assert!(!defers_generation(path), "{path}");
        }
    }

    #[test]
    fn only_creating_posts_are_charged_their_usage() {
        let post = |p| is_generating_request(&Method::POST, p);
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/Responses/",
            "/v1/embeddings",
            "/v1/audio/transcriptions",
            "/v1/audio/speech",
            "/v1/images/generations",
            "/v1/respons%65s",
            "/v1/respons%2565s",
            "/v1/threads/runs",
            "/v1/threads/t/runs",
            "/v1/threads/t/runs/r/submit_tool_outputs",
            "/v1/responses/compact",
            "/v1/messages",
            "/v1/batches",
            // A path whose last segment is a create is one, whatever comes before it.
            "/v1/runs/chat/completions",
        ] {
            assert!(post(path), "{path}");
        }
        for path in [
            "/v1/responses/resp_1",
            "/v1/responses/resp_1/cancel",
            "/v1/responses%2Fresp_1",
            "/v1/chat/completions/chatcmpl-1",
            "/v1/threads/t/runs/r",
            "/v1/threads/t/runs/r/cancel",
            "/v1/batches/b/cancel",
            "/v1/fine_tuning/jobs/j/cancel",
        ] {
            assert!(!post(path), "{path}");
        }
        assert!(!is_generating_request(&Method::GET, "/v1/responses"));
        assert!(!is_generating_request(&Method::GET, "/v1/chat/completions"));
    }

    #[test]
    fn the_known_paths_read_as_their_segments_do() {
        for (path, reading) in KNOWN {
            let segments = Reading {
                completion: reads_as_completion(path),
                responses: reads_as_responses(path),
                generating: reads_as_generating(path),
                deferred: reads_as_deferred(path),
            };
            assert_eq!(reading, segments, "{path}");
            assert_eq!(known(path), Some(reading));
        }
        // Only the exact spelling is known; any other goes segment by segment, as before.
        assert_eq!(known("/v1/chat/completions/"), None);
        assert_eq!(known("/V1/chat/completions"), None);
    }

    #[test]
    fn completion_paths_are_matched_as_a_lenient_upstream_reads_them() {
        assert!(is_completion_path("/v1/chat/completions"));
        assert!(is_completion_path("/v1/completions"));
        assert!(is_completion_path("/v1/chat/completion%73"));
        assert!(is_completion_path("/v1/chat%2Fcompletions"));
        assert!(is_completion_path("/v1/chat/Completions"));
        assert!(is_completion_path("/v1/chat/completions/"));
        assert!(is_completion_path("/v1/chat/COMPLETION%53//"));
        assert!(is_completion_path("/v1/chat/completions;v=1"));
        assert!(is_completion_path("/v1/chat/completions%3Bx/"));
        assert!(is_completion_path("/v1/chat/completions/;x"));
        assert!(is_completion_path("/v1//completions"));
        assert!(is_completion_path("/v1/chat%5Ccompletions"));
        assert!(is_completion_path("/v1/chat\\completions"));
        assert!(is_completion_path("/completions"));
        // Decoded twice, as a proxy in front of the upstream and the upstream may each decode.
        assert!(is_completion_path("/v1/chat/completion%2573"));
        assert!(is_completion_path("/v1/chat%252Fcompletions"));
        assert!(is_responses_path("/v1/respons%2565s"));
        assert!(!is_completion_path("/v1/chat/completion%2574"));
        assert!(!is_completion_path("/v1/completions-like"));
        assert!(!is_completion_path("/v1/embeddings"));
        assert!(!is_completion_path("/"));
        assert!(!is_completion_path("completions"));
        assert!(!is_completion_path("/v1/chat/completions%2"));
        assert!(!is_completion_path("/v1/models%"));
    }

    #[test]
    fn dot_segments_are_found_encoded_or_not() {
        for path in [
            "/v1/../metrics",
            "/v1/./models",
            "/v1/chat/completions/.",
            "/v1/chat/completions/..",
            "/v1/%2e%2e/admin",
            "/v1/%2E./admin",
            "/v1/chat/completions/%2e",
            "/v1/..;/admin",
            "/v1/..%2fadmin",
            "/v1/..\\admin",
            "/v1/%252e%252e/admin",
        ] {
            assert!(has_dot_segment(path), "{path}");
        }
        for path in [
            "/v1/models",
            "/v1/models/gpt-4.1",
            "/v1/files/a..b",
            "/v1/x/.well-known",
            "/v1/%2e%2e%2e",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }
}
