// Capture pages of a web UI with a headless Chromium (playwright-core drives the system's browser; it downloads
// none). Called by docs/screenshots.py, which starts the servers and says what to capture:
//
//     node docs/screenshots.mjs SPEC.json
//
// SPEC: {"chromium": "/usr/bin/chromium", "shots": [{"path": "x.png", "url": "...", "text": "shown once loaded",
//        "width": 1600, "height": 1000, "settle_ms": 3000, "local_storage": {"key": "value"}, "click": "Tab",
//        "optional": false}]}; a shot marked optional that fails leaves its .failed.png and the others go on.
// Each shot starts with the given browser storage (a UI's remembered choices, such as a side panel closed), clicks
// the element whose text is "click" if given (a tab the URL cannot select), waits for its text,
// then for the page to settle (charts draw after their data arrives), and captures the viewport only: what a
// person sees without scrolling.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core");

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const browser = await chromium.launch({
  executablePath: spec.chromium,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
try {
  for (const shot of spec.shots) {
    const page = await browser.newPage({ viewport: { width: shot.width, height: shot.height } });
    await page.addInitScript((entries) => {
      for (const [key, value] of Object.entries(entries)) window.localStorage.setItem(key, value);
    }, shot.local_storage ?? {});
    await page.goto(shot.url, { waitUntil: "load", timeout: 120000 });
    try {
      if (shot.click) {
        const target = page.getByText(shot.click, { exact: true }).first();
        await target.waitFor({ timeout: 120000 });
        await target.click();
      }
      await page.getByText(shot.text, { exact: false }).first().waitFor({ timeout: 120000 });
    } catch (error) {
      // What the page showed instead, beside the picture it should have been (not one the README uses).
      await page.screenshot({ path: shot.path.replace(/\.png$/, ".failed.png") });
      if (!shot.optional) throw error;
      console.log(`${shot.path}: not taken (${error.message.split("\n")[0]})`);
      await page.close();
      continue;
    }
    await page.waitForTimeout(shot.settle_ms ?? 3000);  // the UIs keep polling, so "no network" never comes
    await page.screenshot({ path: shot.path });
    console.log(`${shot.path} <- ${page.url()}`);
    await page.close();
  }
} finally {
  await browser.close();
}
