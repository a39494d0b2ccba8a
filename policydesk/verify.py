"""Sanity checks for the PolicyDesk benchmark data.

Run: .venv/bin/python -m policydesk.verify
Checks: JSONL parses; ids unique; every policy id has a file; policy length in
range (tokens if a local tokenizer is available, else words); every key fact of an
answerable question / chat turn appears (case-insensitive) in its policy text;
unanswerable items have no key facts.
"""
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"
TOKENIZER_DIR = Path(os.path.expanduser("~/.cache/kvmesh/models/smollm2-135m-instruct"))
WORDS = (900, 1150)
TOKENS = (1300, 1600)


def load_jsonl(path):
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path.name}:{n}: bad JSON: {e}")
    return rows


def main():
    errors = []
    tok = None
    if TOKENIZER_DIR.is_dir():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))

    policies = {p.stem: p.read_text(encoding="utf-8") for p in sorted((HERE / "policies").glob("*.md"))}
    print(f"{'policy':24} {'words':>6} {'chars':>6} {'tokens':>7}")
    for pid, text in policies.items():
        words = len(re.findall(r"[A-Za-z0-9€]\S*", text))
        ntok = len(tok.encode(text, add_special_tokens=False)) if tok else None
        print(f"{pid:24} {words:6d} {len(text):6d} {ntok if ntok is not None else '-':>7}")
        if not WORDS[0] <= words <= WORDS[1]:
            errors.append(f"{pid}: {words} words outside {WORDS}")
        if ntok is not None and not TOKENS[0] <= ntok <= TOKENS[1]:
            errors.append(f"{pid}: {ntok} tokens outside {TOKENS}")
        if not text.startswith("# "):
            errors.append(f"{pid}: policy must start with '# <title>'")

    def check_item(where, pid, kf, answerable):
        if pid not in policies:
            errors.append(f"{where}: unknown policy {pid!r}")
            return
        low = policies[pid].lower()
        if answerable:
            if not kf:
                errors.append(f"{where}: answerable but no key_facts")
            for fact in kf:
                if fact.lower() not in low:
                    errors.append(f"{where}: key fact {fact!r} not in {pid}")
        elif kf:
            errors.append(f"{where}: unanswerable but has key_facts")

    questions = load_jsonl(HERE / "questions.jsonl")
    chats = load_jsonl(HERE / "chats.jsonl")
    ids = [q["id"] for q in questions] + [c["id"] for c in chats]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        errors.append(f"duplicate ids: {sorted(dup)}")

    for q in questions:
        for key in ("id", "policy", "question", "reference_answer", "key_facts", "answerable"):
            if key not in q:
                errors.append(f"{q.get('id')}: missing {key}")
        check_item(q["id"], q["policy"], q["key_facts"], q["answerable"])
    for c in chats:
        if not 3 <= len(c["turns"]) <= 6:
            errors.append(f"{c['id']}: {len(c['turns'])} turns")
        for i, t in enumerate(c["turns"], 1):
            check_item(f"{c['id']} turn {i}", c["policy"], t["key_facts"], t.get("answerable", True))

    print()
    for pid in policies:
        qs = [q for q in questions if q["policy"] == pid]
        cs = [c for c in chats if c["policy"] == pid]
        print(f"{pid:24} questions={len(qs):3d} (unanswerable {sum(not q['answerable'] for q in qs)}) "
              f"chats={len(cs)} turns={sum(len(c['turns']) for c in cs)}")
    print(f"total: {len(policies)} policies, {len(questions)} questions, {len(chats)} chats, "
          f"{sum(len(c['turns']) for c in chats)} chat turns; tokenizer: {'yes' if tok else 'no (word counts only)'}")
    if errors:
        print("\nFAILED:")
        for e in errors:
            print("  " + e)
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
