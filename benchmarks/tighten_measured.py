"""Re-record the predictions of tests/data/measured that moved closer to the (never changed) measurement, so
the recorded error, and with it the tests' tolerance, tightens: the engine rows (tests/test_measured_rows.py)
and the differential draws (tests/test_differential.py ``RECORDED_FILES``: ``predicted`` only, never a measured
field). A prediction that moved further is never written here: it fails its test until re-recorded on purpose.
Run: PYTHONPATH=$PWD python benchmarks/tighten_measured.py"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tests.test_measured_rows as m
import tests.test_differential as td
from validate.engines.differential import replay
for engine in m.ENGINE_NAMES:
    path = m.MEASURED / f"{engine}.json"
    d = json.loads(path.read_text()); changed = 0
    for rec in d["rows"]:
        pred = m.predict(rec)
        for r, p in zip(rec["ranks"], pred):
            for ph in m.PHASES:
                meas = r["measured_peak_bytes_by_phase"][ph]; old = r["predicted_peak_bytes_by_phase"][ph]; new = p["peak_bytes_by_phase"][ph]
                if meas is None or old is None or new is None: continue
                if abs(meas - new) < abs(meas - old):
                    print(engine, rec["name"], r["rank"], ph, old, "->", new, "measured", meas); r["predicted_peak_bytes_by_phase"][ph] = new; changed += 1
    if changed:
        path.write_text(json.dumps(d, indent=1) + "\n")
    print(engine, changed)
for path in td.RECORDED_FILES:  # the differential draws: record["measured"][rank][phase] vs record["predicted"][rank][phase]
    text = path.read_text(); d = json.loads(text); changed = 0
    for rec in d["results"] + d.get("cases", []):
        got = replay(rec, Path(tempfile.mkdtemp()))
        for rank, phases in got.measured.items():
            old_of = rec["predicted"][str(rank)]
            for ph, meas in phases.items():
                old, new = old_of[ph], got.predicted[rank][ph]
                if abs(meas - new) < abs(meas - old):
                    print(path.name, rec["name"], rank, ph, old, "->", new, "measured", meas); old_of[ph] = new; changed += 1
    if changed:  # the file's own layout (indent 1, with or without a final newline)
        path.write_text(json.dumps(d, indent=1) + ("\n" if text.endswith("\n") else ""))
    print(path.name, changed)
