#!/usr/bin/env python3
"""The console in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright.

Run by tests/console_browser.rs against a running `floodgate serve`:

    browser.py --admin URL --gateway URL --secret S --key K --key-id ID --many N --out DIR
        [--chromium PATH]

Signs in, sees a usage bar move after requests, sees the refusal's alert with its count, sees
the alerts of N more keys refused (`many-00`..., secret `sk-many-00-browser`...) a page at a
time, resets the key with the confirmation and sees its next request pass; a screenshot of each
page goes to DIR. The page must log no error (a CSP violation, a script error). Exits 0 when all
holds, 1 on a failure, 77 when it cannot run (no Playwright, no Chromium).
"""

import argparse
import os
import re
import shutil
import sys
import urllib.error
import urllib.request

CANNOT_RUN = 77


def chat(gateway, key):
    """One chat completion by `key`: its status."""
    req = urllib.request.Request(
        gateway + "/v1/chat/completions",
        data=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
        headers={"authorization": "Bearer " + key, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_used(page, bar, above):
    """Waits until the bar's `data-used` (the sliding estimate) is above `above`: on the real clock a minute boundary may pass mid-test, and then earlier
    requests weigh a little less every second (docs/design.md §1)."""
    page.wait_for_function(
        "([sel, above]) => { const b = document.querySelector(sel);"
        " return b !== null && Number(b.dataset.used) > above; }",
        arg=[bar, above],
        timeout=20_000,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--admin", required=True)
    p.add_argument("--gateway", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--key-id", required=True)
    p.add_argument("--many", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError as e:
        print(f"cannot run: the playwright Python package is missing ({e})", file=sys.stderr)
        return CANNOT_RUN
    if not os.access(args.chromium, os.X_OK):
        print(f"cannot run: no Chromium at {args.chromium}", file=sys.stderr)
        return CANNOT_RUN
    os.makedirs(args.out, exist_ok=True)
    shot = lambda page, name: page.screenshot(path=os.path.join(args.out, name), full_page=True)
    row = f'tr[data-scope="key"][data-id="{args.key_id}"]'
    bar = row + ' .limit[data-kind="requests"] .bar'

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 720})
        errors = []
        # Answers of 401 (signed out, a wrong secret) and 404 (no favicon) are expected and
        # logged as failed loads; anything else (a CSP refusal, a script error) is a failure.
        page.on(
            "console",
            lambda m: errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None,
        )
        page.on("pageerror", lambda e: errors.append(str(e)))
        expect.set_options(timeout=20_000)

        # Sign in: the secret typed once.
        page.goto(args.admin + "/")
        expect(page.locator("#signin")).to_be_visible()
        expect(page.locator("#tabs")).to_be_hidden()
        shot(page, "signin.png")
        page.fill("#secret", "not-the-secret")
        page.click("#signin-form button")
        expect(page.locator("#signin-error")).to_contain_text("not the admin secret")
        page.fill("#secret", args.secret)
        page.click("#signin-form button")
        expect(page.locator("#tabs")).to_be_visible()
        # The session survives a reload (the cookie, not the page, holds it).
        page.reload()
        expect(page.locator("#tabs")).to_be_visible()

        # Usage: the key's bar at 0, then moving with its requests.
        page.click("#tab-usage")
        page.fill("#filter-id", args.key_id)
        expect(page.locator(bar)).to_have_attribute("data-used", "0")
        for _ in range(2):
            assert chat(args.gateway, args.key) == 200
        wait_used(page, bar, 1.5)
        assert chat(args.gateway, args.key) == 200
        assert chat(args.gateway, args.key) == 429
        wait_used(page, bar, 2.1)
        expect(page.locator(bar)).to_have_class(re.compile(r"^bar (warn|full)$"))
        page.fill("#filter-id", "")
        expect(page.locator("#usage-rows tr").first).to_be_visible()
        shot(page, "usage.png")

        # Notifications: the refusal, counted, on today's alert; marked read, it stays.
        page.click("#tab-notifications")
        alert = page.locator(f'li.alert[data-subject="key {args.key_id}"]')
        expect(alert).to_have_attribute("data-count", "1")
        expect(alert).to_contain_text("1 request refused")
        expect(page.locator("#unread")).to_have_text("1")
        expect(alert.locator(".chart span")).to_have_count(14)
        shot(page, "notifications.png")
        alert.locator("button.mark").click()
        expect(alert).to_have_class("alert read")
        expect(page.locator("#unread")).to_be_hidden()

        # More keys refused than a page holds: each twice, so all before the key's one refusal.
        for i in range(args.many):
            key = f"sk-many-{i:02}-browser"
            assert chat(args.gateway, key) == 200
            for _ in range(2):
                assert chat(args.gateway, key) == 429
        total = args.many + 1
        pages = page.locator("#alerts-page-info")
        expect(pages).to_have_text(f"1–50 of {total}")
        expect(page.locator("li.alert")).to_have_count(50)
        expect(page.locator("li.alert").first).to_have_attribute("data-subject", "key many-00")
        expect(page.locator("#unread")).to_have_text("50+")
        expect(page.locator("#alerts-prev-page")).to_be_disabled()
        page.click("#alerts-next-page")
        expect(pages).to_have_text(f"51–{total} of {total}")
        expect(page.locator("li.alert")).to_have_count(total - 50)
        expect(page.locator("#alerts-next-page")).to_be_disabled()
        # The key's alert, on the last page, still read; the badge still counts the newest page.
        expect(alert).to_have_class("alert read")
        expect(page.locator("#unread")).to_have_text("50+")
        shot(page, "notifications-page-2.png")
        page.click("#alerts-prev-page")
        expect(pages).to_have_text(f"1–50 of {total}")

        # Reset, confirmed: the bar back at 0, and the key passes again.
        page.click("#tab-usage")
        page.fill("#filter-id", args.key_id)
        page.locator(row + " button.reset").click()
        expect(page.locator("#confirm")).to_be_visible()
        page.click("#confirm-cancel")
        expect(page.locator("#confirm")).to_be_hidden()
        assert chat(args.gateway, args.key) == 429, "cancelled: nothing was reset"
        page.locator(row + " button.reset").click()
        page.click("#confirm-reset")
        expect(page.locator(bar)).to_have_attribute("data-used", "0")
        assert chat(args.gateway, args.key) == 200
        wait_used(page, bar, 0.5)

        # Signed out: the form again.
        page.click("#sign-out")
        expect(page.locator("#signin")).to_be_visible()
        browser.close()
        if errors:
            print("the page logged errors:\n" + "\n".join(errors), file=sys.stderr)
            return 1
    print("console: all checks passed; screenshots in " + args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
