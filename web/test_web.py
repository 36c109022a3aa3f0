"""The page in a real browser: headless Chromium driven by Selenium loads web/index.html from the
file system, sets the form's fields, and reads the numbers the page shows; they must be the CLI's
for the same setup (rows of ../shared/validation/dev.tsv and fresh random setups). A broken
config.json must show an error in the page, and no request may leave it.

Needs web/index.html (make web), chromium and chromedriver (apt-get install chromium
chromium-driver) and selenium (pip install selenium). Writes build/web_checks.tsv (CLI, Python
and page, row by row) and, with MEMANAT_SCREENSHOT=PATH, the screenshot the README shows.
"""
import json
import os
import random
import shlex
import shutil
import subprocess
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PAGE = os.path.join(ROOT, "web", "index.html")
DEV_TSV = os.path.join(ROOT, "..", "shared", "validation", "dev.tsv")
KEYS = ["weights", "master_weights", "gradients", "optimizer", "model_states", "activations",
        "temporary", "kv_cache", "workspace", "peak_allocated", "peak_reserved", "context",
        "device_used", "capacity"]
CHECKS = []  # (setup, CLI device_used, Python device_used or "", page device_used)

webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")


def cli_path() -> str:
    p = os.environ.get("MEMANAT_BIN") or "memanat"
    return p if os.path.isabs(p) else os.path.join(ROOT, p)


def cli_json(args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    p = subprocess.run([cli_path()] + args + ["--json"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode in (0, 1), p.stderr  # 1: the step does not fit, the answer printed
    return json.loads(p.stdout)


def python_device_used(args):
    try:
        import memanat
    except ImportError:
        return ""
    kw = {}
    i = 0
    while i < len(args):
        name = args[i][2:].replace("-", "_")
        if name == "infer":
            kw[name], i = True, i + 1
        else:
            kw[name], i = args[i + 1], i + 2
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return memanat.estimate(**kw).device_used
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(PAGE):
        pytest.skip("web/index.html not built (make web)")
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chrome or not driver_bin:
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1360,1000", "--no-first-run", "--disable-extensions",
              "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--disable-default-apps"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    service = webdriver.ChromeService(executable_path=driver_bin)
    d = webdriver.Chrome(options=opts, service=service)
    d.set_script_timeout(60)
    try:
        d.get("file://" + PAGE)
        wait(d, "return !!(window.memanat && window.memanat.ready)")
        yield d
    finally:
        d.quit()


def wait(d, script, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        v = d.execute_script(script)
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for: " + script)


def set_fields(d, fields, typed=True):
    """Sets the form and returns once the page has redrawn: typed, the way a person does (keys
    into inputs, options picked one by one), else all values at once from a script (faster: the
    page redraws once instead of at every pause in the typing)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    d.execute_script("""
        for (const el of document.getElementById('form').elements) {
            if (!el.name) continue;
            if (el.type === 'checkbox') el.checked = false;
            else if (el.tagName === 'SELECT') el.value = el.options[0].value;
            else el.value = '';
        }""")
    if not typed:
        d.execute_script("""
            const f = arguments[0];
            for (const [k, v] of Object.entries(f)) {
                const el = document.getElementsByName(k)[0];
                if (el.type === 'checkbox') el.checked = true; else el.value = v;
                if (el.value !== v && el.type !== 'checkbox') throw new Error(k + ': no ' + v);
            }""", fields)
        fields = {}
    for name, value in fields.items():
        el = d.find_element(By.NAME, name)
        if el.tag_name == "select":
            opts = [o.get_property("value") for o in Select(el).options]
            assert value in opts, "%s: the page offers no %r (%s)" % (name, value, opts)
            Select(el).select_by_index(opts.index(value))
        elif el.get_attribute("type") == "checkbox":
            el.click()
        elif name == "config_json":  # pasted, not typed: a config is long
            d.execute_script("arguments[0].value = arguments[1];"
                             "arguments[0].dispatchEvent(new Event('input', {bubbles: true}))",
                             el, value)
        else:
            el.send_keys(value)
    # typing may have redrawn the page half-way; this last event redraws it with every field set
    before = d.execute_script("return window.memanat.updates")
    d.execute_script("document.getElementById('form').dispatchEvent("
                     "new Event('input', {bubbles: true}))")
    wait(d, "return window.memanat.updates > %d && (window.memanat.done === "
            "window.memanat.updates || document.getElementById('error').style.display === "
            "'block')" % before)


def shown(d):
    """The bytes the page's table shows, by key."""
    return d.execute_script("""
        const out = {};
        for (const td of document.querySelectorAll('td[data-key]'))
            out[td.dataset.key] = Number(td.dataset.bytes);
        return out;""")


def fields_of(args):
    """CLI flags -> the page's form fields (the page names them as the CLI does)."""
    f = {}
    i = 0
    while i < len(args):
        name = args[i][2:].replace("-", "_")
        if name == "infer":
            f[name], i = "1", i + 1
            continue
        value = args[i + 1]
        i += 2
        if name == "config":
            with open(os.path.join(ROOT, value), encoding="utf-8") as fh:
                f["config_json"] = fh.read()
        elif name == "model":
            f["model"] = value
        elif name == "quant_head":  # a checkbox
            if value == "yes":
                f[name] = "1"
        else:
            f[name] = value
    return f


def dev_rows():
    rows = []
    if os.path.exists(DEV_TSV):
        with open(DEV_TSV, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("#") or not line.strip():
                    continue
                col = line.rstrip("\n").split("\t")
                rows.append((col[0], shlex.split(col[5])))
    return rows


def check_same(d, label, args, typed):
    want = cli_json(["estimate"] + args)
    set_fields(d, fields_of(args), typed)
    err = d.execute_script("return document.getElementById('error').textContent")
    assert not err, "%s: the page says %s" % (label, err)
    got = shown(d)
    for k in KEYS:
        assert got[k] == want[k], "%s: %s page %s CLI %s" % (label, k, got[k], want[k])
    CHECKS.append((label, want["device_used"], python_device_used(args), got["device_used"]))


def test_dev_rows_same_as_cli(browser):
    rows = dev_rows()
    assert len(rows) >= 19, "dev.tsv: the validation set lives in ../shared beside the checkout"
    for i, (row_id, args) in enumerate(rows):
        check_same(browser, row_id, args, typed=i % 6 == 0)


def test_random_setups_same_as_cli(browser):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for n in range(6):
        precision = rng.choice(["fp32", "fp16", "bf16"])
        gpus = ["a100-80gb", "a10g", "h100-80gb"] + (["t4"] if precision != "bf16" else [])
        args = ["--model", rng.choice(["gpt2", "bert-base-uncased", "llama-3-8b", "t5-base",
                                       "mistral-7b"]),
                "--batch", str(rng.randint(1, 8)), "--seq", str(rng.choice([128, 256, 512])),
                "--precision", precision,
                "--optim", rng.choice(["adamw", "adamw-8bit", "adafactor"]),
                "--checkpointing", rng.choice(["none", "full", "selective"]),
                "--gpu", rng.choice(gpus)]  # (bf16 needs sm 80: the T4 refuses it)
        if rng.random() < 0.4:
            args += ["--lora-rank", "16", "--quant", rng.choice(["none", "nf4", "fp4-dq"])]
        if rng.random() < 0.3:
            args += ["--framework", "deepspeed", "--gpus", "8", "--zero", str(rng.randint(1, 3))]
        check_same(browser, "random %d (seed %d)" % (n, seed), args, typed=n == 0)


def test_fit_and_plan_shown(browser):
    args = ["--model", "llama-2-7b", "--gpu", "a10g", "--batch", "4", "--seq", "1024"]
    want = cli_json(["fit"] + args)
    set_fields(browser, fields_of(args))
    page = browser.execute_script("return window.memanat.fit")
    assert page["max_batch"] == want["max_batch"] and page["max_seq"] == want["max_seq"]
    assert [p["what"] for p in page["plan"]] == [p["what"] for p in want["plan"]]
    text = browser.execute_script("return document.getElementById('fit').textContent")
    for p in want["plan"]:
        assert p["what"] in text
    svg = browser.execute_script("return document.querySelector('#timeline svg') !== null")
    assert svg


def test_shareable_url(browser):
    args = ["--model", "gpt2", "--batch", "3", "--seq", "256", "--precision", "fp16"]
    set_fields(browser, fields_of(args))
    url = browser.current_url
    assert "batch=3" in url and "precision=fp16" in url
    browser.get("about:blank")
    browser.get(url)
    wait(browser, "return !!(window.memanat && window.memanat.ready && window.memanat.estimate)")
    want = cli_json(["estimate"] + args)
    assert shown(browser)["device_used"] == want["device_used"]


def test_bad_config_shows_error(browser):
    set_fields(browser, {"config_json": '{"model_type": "llama", "hidden_size": [}'})
    err = browser.execute_script("return document.getElementById('error').textContent")
    visible = browser.execute_script(
        "return document.getElementById('error').style.display === 'block'")
    assert visible and "line 1" in err, err
    set_fields(browser, {"config_json": '{"model_type": "mixtral", "hidden_size": 4096}'})
    err = browser.execute_script("return document.getElementById('error').textContent")
    assert "mixtral" in err or "mixture" in err.lower() or "support" in err.lower(), err
    set_fields(browser, {"model": "gpt2", "batch": "0"})
    err = browser.execute_script("return document.getElementById('error').textContent")
    assert "batch" in err, err
    # past the 1 TiB the 32-bit build simulates, with a capacity that would hold the allocated
    # peak: the replay decides, and it cannot run here, so a message, not a guessed number
    set_fields(browser, {"params": "1e11", "seq": "16", "capacity": "1900GiB"}, typed=False)
    err = browser.execute_script("return document.getElementById('error').textContent")
    assert "32-bit" in err, err


# The keys that do not depend on the allocator replay: the step's own bytes (the estimator counts
# them without the allocator), the requested peak, the context and the verdict. The allocated
# peak does (the allocator's rounding of whole blocks): without the replay it is the step's own,
# a lower bound.
UNREPLAYED = ["weights", "master_weights", "gradients", "optimizer", "model_states",
              "activations", "temporary", "kv_cache", "workspace", "peak_requested", "context",
              "capacity", "fits", "params", "trainable_params", "peak_phase"]


@pytest.mark.parametrize("model", ["llama-2-70b", "llama-3-70b"])
def test_big_step_numbers_and_fit(browser, model):
    """Full training of a 70B model on one 80 GiB GPU needs more than the 32-bit build can
    replay: the page still shows every number the replay does not decide, equal to the CLI's,
    labels reserved and device used as lower bounds, and fit gives the CLI's answer."""
    gpu = random.choice(["h100-80gb", "a100-80gb"])
    args = ["--model", model, "--gpu", gpu, "--precision", random.choice(["fp32", "bf16"]),
            "--batch", str(random.randint(1, 4)), "--seq", str(random.choice([512, 1024]))]
    want = cli_json(["estimate"] + args)
    set_fields(browser, fields_of(args), typed=False)
    err = browser.execute_script("return document.getElementById('error').textContent")
    assert not err, err
    e = browser.execute_script("return window.memanat.estimate")
    assert e.get("replayed") is False, "this step was expected past the 32-bit replay"
    for k in UNREPLAYED:
        assert e[k] == want[k], "%s: %s page %s CLI %s" % (model, k, e[k], want[k])
    got = shown(browser)
    for k in ("weights", "gradients", "optimizer", "activations", "model_states"):
        assert got[k] == want[k], (k, got[k], want[k])
    # lower bounds, labelled as such
    assert want["peak_requested"] <= got["peak_allocated"] <= want["peak_allocated"]
    assert got["peak_reserved"] == got["peak_allocated"] <= want["peak_reserved"]
    assert got["device_used"] == want["context"] + got["peak_allocated"] <= want["device_used"]
    assert got["device_used"] > want["capacity"]
    note = browser.execute_script("const n = document.getElementById('noreplay');"
                                  "return n.style.display === 'block' && n.textContent")
    assert note and "not replayed" in note
    verdict = browser.execute_script("return document.getElementById('verdict').textContent")
    assert verdict.startswith("does not fit: at least"), verdict
    fit_want = cli_json(["fit"] + args)
    f = browser.execute_script("return window.memanat.fit")
    assert f, "fit did not answer"
    for k in ("max_batch", "max_seq", "plan_found", "plan_slowdown", "plan"):
        assert f[k] == fit_want[k], (k, f[k], fit_want[k])
    for k in KEYS:
        assert f["estimate"][k] == fit_want["estimate"][k], k
    text = browser.execute_script("return document.getElementById('fit').textContent")
    for p in fit_want["plan"]:
        assert p["what"] in text


def test_newer_settings(browser):
    """The settings the CLI gained: lengths with steps/seed/percentile, LoRA dropout, the
    optimizer's implementation, the loop, bitsandbytes' release and head, and the explain view;
    each one's numbers equal the CLI's, and the shareable URL holds them."""
    rng = random.Random()
    lo, hi = rng.choice([32, 64]), rng.choice([512, 1024])
    lengths = ["--model", "gpt2", "--batch", str(rng.randint(2, 6)),
               "--seq-lengths", "%d:%d:%d" % (lo, hi, rng.randint(lo + 1, hi - 1)),
               "--steps", str(rng.randint(4, 12)), "--seed", str(rng.randint(0, 999)),
               "--percentile", str(rng.choice([50, 90, 100]))]
    want = cli_json(["estimate"] + lengths)
    set_fields(browser, fields_of(lengths))
    e = browser.execute_script("return window.memanat.estimate")
    assert e["seq_lengths"] == want["seq_lengths"]
    assert shown(browser)["device_used"] == want["device_used"]
    used = browser.execute_script("return Number(document.getElementById('len_used')"
                                  ".dataset.bytes)")
    assert used == want["seq_lengths"]["device_used"]
    url = browser.current_url
    assert "seq_lengths=" in url and "steps=" in url and "percentile=" in url
    browser.get("about:blank")
    browser.get(url)
    wait(browser, "return !!(window.memanat && window.memanat.ready && window.memanat.estimate)")
    assert browser.execute_script("return window.memanat.estimate")["seq_lengths"] == \
        want["seq_lengths"]
    others = [
        ["--model", "llama-2-7b", "--lora-rank", "16", "--lora-dropout",
         str(rng.choice([0.05, 0.1])), "--quant", "nf4", "--bnb-version", "0.43.1",
         "--quant-head", "yes", "--seq", "512"],
        ["--model", "gpt2", "--optim-impl", rng.choice(["fused", "loop"]),
         "--loop", "trainer", "--seq", "256", "--batch", str(rng.randint(1, 4))],
    ]
    for args in others:
        check_same(browser, " ".join(args), args, typed=False)
    args = ["--model", "gpt2", "--seq", "512", "--batch", str(rng.randint(1, 8))]
    want = cli_json(["estimate", "--explain"] + args)
    set_fields(browser, dict(fields_of(args), explain="1"), typed=False)
    e = browser.execute_script("return window.memanat.estimate")
    assert e["explain"] == want["explain"] and e["explain_peak"] == want["explain_peak"]
    rows = browser.execute_script("return document.querySelectorAll('#explain_table tr').length")
    assert rows == len(want["explain"]) + 1
    assert "explain=1" in browser.current_url


def test_nothing_sent_over_the_network(browser):
    """Every request the browser made while the tests ran: the page itself, nothing else."""
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    assert urls, "the performance log recorded no request at all"
    strays = [u for u in urls if not (u.startswith("file://") or u.startswith("data:")
                                      or u == "about:blank")]
    assert not strays, strays


def test_timing_and_screenshot(browser):
    """The time from an edit to the redrawn breakdown (printed), and the README's screenshot."""
    args = ["--model", "llama-3-8b", "--batch", "2", "--seq", "2048", "--precision", "bf16",
            "--gpu", "h100-80gb", "--lora-rank", "16", "--checkpointing", "selective"]
    set_fields(browser, fields_of(args))
    times = []
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    el = browser.find_element(By.NAME, "batch")
    for b in ("3", "4", "5", "2"):
        el.send_keys(Keys.CONTROL, "a")
        el.send_keys(b)  # replaces the selection: one edit
        wait(browser, "return window.memanat.estimate.batch === %s && window.memanat.done === "
                      "window.memanat.updates" % b)
        times.append(browser.execute_script(
            "return [window.memanat.estimateMs, window.memanat.inputToDrawnMs]"))
    print("\n    llama-3-8b, batch 2..5: estimate %s ms; last keystroke to drawn breakdown %s ms "
          "(60 ms of it the typing pause the page waits for)"
          % (", ".join("%.1f" % t[0] for t in times), ", ".join("%.0f" % t[1] for t in times)))
    shot = os.environ.get("MEMANAT_SCREENSHOT")
    if shot:
        browser.execute_script("document.activeElement.blur(); window.scrollTo(0, 0)")
        browser.save_screenshot(shot)
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    with open(os.path.join(ROOT, "build", "web_checks.tsv"), "w", encoding="utf-8") as f:
        f.write("setup\tCLI device_used\tPython device_used\tpage device_used\n")
        for row in CHECKS:
            f.write("\t".join(str(x) for x in row) + "\n")


def test_safetensors_headers_same_as_cli(browser, tmp_path):
    """Shards picked in the page (and the index): the exact parameter count and dtype from their
    headers equal the CLI's on the same folder; a missing shard and a broken one show errors."""
    import sys
    from selenium.webdriver.common.by import By
    sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
    from conftest import write_checkpoint
    rng = random.Random()
    for shards in (1, rng.randint(2, 4)):
        folder = str(tmp_path / ("ckpt%d" % shards))
        ck = write_checkpoint(folder, rng, shards)
        want = cli_json(["estimate", "--config", folder, "--seq", "64"])
        assert want["params"] == ck["params"]
        browser.execute_script("document.getElementById('reset').click()")
        set_fields(browser, {"config_json": json.dumps(ck["config"]), "seq": "64"}, typed=False)
        picked = ck["files"] + ([ck["index"]] if ck["index"] else [])
        browser.find_element(By.ID, "weights").send_keys("\n".join(picked))
        wait(browser, "const e = window.memanat.estimate; return e && e.safetensors && "
                      "e.safetensors.files === %d && window.memanat.done === "
                      "window.memanat.updates" % shards)
        got = shown(browser)
        for k in KEYS:
            assert got[k] == want[k], (k, got[k], want[k])
        e = browser.execute_script("return window.memanat.estimate")
        assert e["params"] == ck["params"] and e["safetensors"]["dtype"] == ck["dtype"]
        info = browser.execute_script("return document.getElementById('weights_info')"
                                      ".textContent")
        assert "{:,}".format(ck["params"]) in info and ck["dtype"] in info, info
        if ck["index"]:  # the index names a shard that was not picked
            browser.find_element(By.ID, "weights").clear()
            browser.find_element(By.ID, "weights").send_keys(
                "\n".join(ck["files"][1:] + [ck["index"]]))
            wait(browser, "return document.getElementById('error').textContent"
                          ".includes('listed in the index')")
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes((1000).to_bytes(8, "little") + b'{"a": ')
    browser.find_element(By.ID, "weights").clear()
    browser.find_element(By.ID, "weights").send_keys(str(bad))
    wait(browser, "return document.getElementById('error').textContent.includes('broken')")
    browser.execute_script("document.getElementById('reset').click()")
