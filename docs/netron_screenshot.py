"""Screenshot an exported ONNX graph as Netron draws it, for the README.

    python docs/netron_screenshot.py EXPORT/decode.onnx docs/onnx-decode-netron.png [--width 1400] [--crop Y0:Y1]

Netron (pip install netron) serves the model on localhost; a headless Chromium (Debian's `chromium` package, driven
by `pip install playwright`, which is told to use that browser instead of downloading its own) opens it, accepts
Netron's first-run notice, waits for the graph, grows the window to the graph's size and saves a PNG. `--crop`
keeps rows Y0..Y1 of the page (pixels), to show one region of a tall graph. None of this is a sharpi dependency.
"""
from __future__ import annotations

import argparse
import time

PORT = 8765


def screenshot(model: str, out: str, width: int, max_height: int, crop: tuple[int, int] | None,
               browser_path: str) -> None:
    import netron
    from playwright.sync_api import sync_playwright

    netron.serve(model, None, address=("localhost", PORT), browse=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": 1000})
        page.goto(f"http://localhost:{PORT}")
        for _ in range(60):      # the first-run notice, then the graph's nodes
            accept = page.get_by_text("Accept")
            if accept.count() and accept.first.is_visible():
                accept.first.click()
            if page.locator("#canvas g.node").count():
                break
            time.sleep(1)
        else:
            raise SystemExit("Netron did not draw the graph within a minute.")
        time.sleep(2)
        box = page.locator("#canvas").bounding_box()
        width = max(width, int(box["width"]) + 100)      # the whole graph, however wide
        page.set_viewport_size({"width": width, "height": min(max_height, int(box["height"]) + 200)})
        time.sleep(2)
        clip = None
        if crop:
            clip = {"x": 0, "y": crop[0], "width": width, "height": crop[1] - crop[0]}
        page.screenshot(path=out, full_page=True, clip=clip)
        browser.close()
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--max-height", type=int, default=6000)
    p.add_argument("--crop", default=None, help="Y0:Y1, page rows to keep")
    p.add_argument("--browser", default="/usr/bin/chromium")
    args = p.parse_args()
    crop = tuple(int(v) for v in args.crop.split(":")) if args.crop else None
    screenshot(args.model, args.out, args.width, args.max_height, crop, args.browser)


if __name__ == "__main__":
    main()
