//! Server-sent events pass through chunk by chunk: the first chunk reaches the caller long
//! before a delayed last chunk, metered or not.

mod common;

use std::time::Duration;

use common::*;

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "metered"
secret = "sk-metered"
[[keys]]
id = "plain"
secret = "sk-plain"
[[rate_limits]]
scope = "key"
id = "metered"
rpm = 100
tpm = 100000
"#;

const DELAY: Duration = Duration::from_millis(1200);

#[tokio::test]
async fn sse_chunks_arrive_before_the_stream_ends() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    for key in ["sk-metered", "sk-plain"] {
        let mut req = gw.request("POST", "/v1/chat/completions", Some(key), CHAT_STREAM);
        req.headers_mut().insert(
            "x-test-last-delay-ms",
            DELAY.as_millis().to_string().parse().unwrap(),
        );
        let (status, headers, frames) = gw.frames(req).await;
        assert_eq!(status, 200);
        assert_eq!(headers["content-type"], "text/event-stream");
        let (first_at, first) = &frames[0];
        let (last_at, _) = frames.last().unwrap();
        assert!(first.starts_with(b"data: "), "{first:?}");
        assert!(
            *first_at < DELAY / 2,
            "{key}: first chunk after {first_at:?}, the stream was buffered"
        );
        assert!(
            *last_at >= DELAY,
            "{key}: the last chunk came after the delay"
        );
        let body: Vec<u8> = frames.iter().flat_map(|(_, b)| b.to_vec()).collect();
        assert_eq!(events(&body).last().map(String::as_str), Some("[DONE]"));
    }
}
