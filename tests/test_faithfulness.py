"""``kvmesh eval faithfulness`` (bench/faithfulness.py): the scorer's rules on hand examples, and
one real run with smollm2 where the configuration equals the reference."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import faithfulness as F
from bench import gate as G
from bench import scoring as S
import policydesk


# ---- key facts and normalisation ----------------------------------------------------------------

@pytest.mark.parametrize("answer, fact", [
    ("The cap is €1,500 per year.", "1,500"),
    ("The cap is 1500 EUR per year.", "1,500"),
    ("The cap is 1\u202f500 € per year.", "1500"),            # narrow no-break space as thousands group
    ("Up to EUR 10,000.", "10,000"),
    ("€0,30 per kilometre", "0.30"),                           # decimal comma
    ("Reimbursed at 15 %", "15%"),
    ("Reimbursed at 15 percent", "15%"),
    ("Core hours start at 9:30.", "09:30"),
    ("Ask your HEAD OF DEPARTMENT.", "Head of Department"),
    ("Talk to your line managers", "line manager"),            # a word fact may be followed by letters
    ("It is 230.", "230"),                                     # sentence full stop after a number
    ("within 3\u2013working days", "3-working days"),         # en dash
    ("  30\n days ", "30 days"),
])
def test_fact_found(answer, fact):
    assert S.contains_fact(answer, fact)


@pytest.mark.parametrize("answer, fact", [
    ("up to 150 km", "15"),            # not inside a longer number
    ("15.5 days", "15"),               # nor the integer part of a decimal
    ("0.5 days", "5"),                 # nor its fractional part
    ("2015 rules", "15"),
    ("our network policy", "two"),     # a word fact starts at a word boundary
    ("5.6 per breakfast", "5.60"),     # documented limit: trailing zeros are not added
    ("two weeks", "2"),                # documented limit: number words are not numbers
    ("The policy does not say.", "CFO"),
])
def test_fact_not_found(answer, fact):
    assert not S.contains_fact(answer, fact)


def test_key_facts_need_all_of_them():
    assert S.key_facts_correct("Head of Department and the CFO", ["Head of Department", "CFO"])
    assert not S.key_facts_correct("Only the CFO", ["Head of Department", "CFO"])
    assert S.normalize("€1,500 — 09:30\u00a0am") == "1500 - 9:30 am"


# ---- unanswerable questions ---------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    "The policy does not say.",
    "The policy doesn\u2019t specify that.",
    "That is not mentioned in the policy.",
    "There is no information about parking.",
    "It's not covered by this policy.",
    "I don't know.",
    "I cannot find this in the policy.",
])
def test_abstentions_are_right(answer):
    assert S.abstains(answer)
    assert S.unanswerable_correct(answer, "Is there a parking allowance?")


@pytest.mark.parametrize("answer", [
    "Yes, you get a parking allowance.",
    "The allowance is 50 per month.",
    "The policy does not say, but it is usually 50 per month.",     # abstains, then invents a figure
    "",
])
def test_made_up_answers_are_wrong(answer):
    assert not S.unanswerable_correct(answer, "Is there a parking allowance?")


def test_numbers_from_the_question_are_not_made_up():
    q = "Can I work from abroad for 30 days?"
    assert S.unanswerable_correct("The policy does not say whether 30 days abroad are allowed.", q)
    assert S.new_numbers("It says 45 days, not 30 days.", q) == ["45"]


def test_is_correct_dispatches_on_answerable():
    ans = {"question": "Hotel cap in London?", "key_facts": ["230"], "answerable": True}
    una = {"question": "Parking?", "key_facts": [], "answerable": False}
    assert S.is_correct("€230 per night", ans) and not S.is_correct("The policy does not say.", ans)
    assert S.is_correct("The policy does not say.", una) and not S.is_correct("€230 per night", una)


# ---- grounding, agreement, accuracy, gate -------------------------------------------------------

def test_grounding_hand_example():
    source = "Hotels in London are capped at 230 euros per night."
    # content words: hotel(s) -> "hotel" not a word of the source, "london", "230", "night", "pizza"
    assert S.content_words("The hotel in London: 230 per night, with pizza!") == ["hotel", "london", "230", "night", "pizza"]
    assert S.grounding("The hotel in London: 230 per night, with pizza!", source) == pytest.approx(3 / 5)
    assert S.grounding("It is the one.", source) is None                  # only stop words
    text = policydesk.system_message("travel_expenses")
    assert S.grounding("The policy does not say.", text) == 1.0           # system prompt words count


def test_first_divergence_and_agreement():
    assert S.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert S.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert S.first_divergence([1, 2], [1, 2, 3, 4]) == 2                  # a prefix: the shorter's length
    assert S.first_divergence([], [7]) == 0
    ag = S.agreement([[1, 2, 3], [4, 5], [6], [1, 2]], [[1, 2, 3], [4, 9], [7], [1, 2, 3]])
    assert ag == {"agreement": 0.25, "num_diverging": 3, "mean_first_divergence": (1 + 0 + 2) / 3}
    assert S.agreement([[1]], [[1]])["mean_first_divergence"] is None
    with pytest.raises(ValueError):
        S.agreement([[1]], [])


def test_accuracy_groups_with_wilson_intervals():
    rows = [{"correct": c, "kind": k, "answerable": a, "policy": p} for c, k, a, p in [
        (True, "question", True, "x"), (False, "question", True, "y"), (True, "chat", False, "x"),
        (True, "chat", True, "y")]]
    acc = F.accuracy(rows)
    assert acc["overall"]["correct"] == 3 and acc["overall"]["n"] == 4 and acc["overall"]["accuracy"] == 0.75
    assert acc["questions"]["accuracy"] == 0.5 and acc["chat_turns"]["accuracy"] == 1.0
    assert acc["unanswerable"]["n"] == 1 and acc["policies"]["y"]["correct"] == 1
    assert F.accuracy_group([]) is None
    assert F.fmt_group(F.accuracy_group([True] * 5 + [False] * 5)) == "50.0% [23.7, 76.3] (5/10)"


# ---- the paired gate (bench/gate.py) ------------------------------------------------------------

def test_wilson_interval_hand_values():
    assert G.wilson_interval(5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    lo, hi = G.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(3.841459 / 13.841459, abs=1e-6)     # z^2 / (n + z^2)
    assert G.wilson_interval(10, 10)[1] == 1.0
    with pytest.raises(ValueError):
        G.wilson_interval(3, 2)


@pytest.mark.parametrize("b, c, p", [
    (0, 0, 1.0),                     # no discordant pairs: no evidence of a difference
    (5, 0, 2 / 32),                  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    (0, 6, 2 / 64),
    (10, 2, 2 * (1 + 12 + 66) / 4096),
    (3, 3, 1.0),                     # 2 * 42/64 > 1: capped
    (7, 3, 2 * (1 + 10 + 45 + 120) / 1024),
])
def test_mcnemar_exact_hand_values(b, c, p):
    assert G.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    assert G.mcnemar_exact(c, b) == pytest.approx(p, rel=1e-12)          # two-sided: symmetric


def test_paired_difference_interval_hand_values():
    # 100 items, 2 lost, 5 gained: difference +3 points; Agresti-Min adds 1/2 to every cell
    diff, lo, hi = G.paired_difference_interval(60, 2, 5, 33)
    d, se = 3 / 102, (8 - 9 / 102) ** 0.5 / 102
    assert diff == pytest.approx(0.03) and lo == pytest.approx(d - G.Z95 * se) and hi == pytest.approx(d + G.Z95 * se)
    with pytest.raises(ValueError):
        G.paired_difference_interval(0, 0, 0, 0)


def _pairs(both_right, lost, gained, both_wrong):
    ref = [True] * both_right + [True] * lost + [False] * gained + [False] * both_wrong
    test = [True] * both_right + [False] * lost + [True] * gained + [False] * both_wrong
    return test, ref


def test_identical_configuration_passes_with_zero_discordant_pairs():
    v = G.verdict(*_pairs(130, 0, 0, 82))                       # the whole set: 212 items
    assert (v["reference_only"], v["test_only"], v["n"]) == (0, 0, 212)
    assert v["verdict"] == G.PASS and v["p_value"] == 1.0 and v["difference_points"] == 0.0
    assert v["difference_ci_points"][0] > -1.0                   # -1.96 / 214 of the items


def test_few_items_are_no_evidence_not_a_pass():
    v = G.verdict(*_pairs(6, 0, 0, 6))                          # identical, but only 12 items
    assert v["verdict"] == G.NO_EVIDENCE and "too few" in v["reason"]
    v = G.verdict(*_pairs(120, 10, 10, 72))                      # as many lost as gained
    assert v["verdict"] == G.NO_EVIDENCE and v["drop_points"] == 0.0


def test_gate_fails_on_a_significant_loss_or_a_drop_over_two_points():
    v = G.verdict(*_pairs(100, 6, 0, 106))                       # p = 1/32 < 0.05
    assert v["verdict"] == G.FAIL and "McNemar" in v["reason"]
    v = G.verdict(*_pairs(100, 5, 0, 107))                       # p = 1/16, but 2.36 points lost
    assert v["p_value"] == pytest.approx(0.0625) and v["verdict"] == G.FAIL and "points below" in v["reason"]
    v = G.verdict(*_pairs(100, 2, 30, 80))                       # much better: passes
    assert v["verdict"] == G.PASS and v["difference_points"] > 0


def test_gate_at_exactly_two_points():
    v = G.verdict(*_pairs(0, 1, 0, 49))                          # 1 of 50 lost: exactly 2.0 points
    assert v["drop_points"] == 2.0 and v["verdict"] != G.FAIL    # not over the limit (too few to pass)
    assert G.verdict(*_pairs(0, 1, 0, 48))["verdict"] == G.FAIL  # 1 of 49: 2.04 points


def test_select_questions_interleaves_policies_and_unanswerables():
    qs = F.select_questions(12)
    assert [q["answerable"] for q in qs].count(False) == 2 and not qs[2]["answerable"]
    assert len({q["policy"] for q in qs}) == 8
    assert len({q["id"] for q in F.select_questions(96)}) == 96
    with pytest.raises(ValueError, match="num_questions"):
        F.select_questions(0)


def test_the_default_set_is_every_question_and_every_chat_turn():
    items = F.select_items()
    assert len(items) == 96 + 116 and len({it["id"] for it in items}) == len(items)
    chats = [it for it in items if it["kind"] == "chat"]
    assert len({it["chat"] for it in chats}) == 24 and chats[0]["id"].endswith("/1") and chats[0]["turn"] == 1
    assert sum(not it["answerable"] for it in chats) == 5
    assert [it["kind"] for it in F.select_items(0, 1)] == ["chat"] * len(F.select_chats(1)[0]["turns"])
    with pytest.raises(ValueError, match="num_chats"):
        F.select_items(1, 25)
    with pytest.raises(ValueError, match="nothing"):
        F.select_items(0, 0)


def test_chat_turns_carry_the_configurations_own_replies():
    items = F.select_items(2, 2)
    seen = []

    async def generate(convs):                     # a fake configuration: replies name the turn it answers
        seen.append(convs)
        return [{"text": f"reply to: {c[-1]['content']}", "token_ids": [len(c)], "finish_reason": "stop"}
                for c in convs]

    answers = asyncio.run(F.answer_items(items, generate))
    assert [a["id"] for a in answers] == [it["id"] for it in items]
    chat = F.select_chats(2)[1]
    n = len(chat["turns"])
    assert len(seen) == max(n, len(F.select_chats(2)[0]["turns"]))   # one round per turn
    assert len(seen[0]) == 2 + 2                                       # the questions and both first turns
    last = next(c for c in seen[n - 1] if c[-1]["content"] == chat["turns"][-1]["user"])
    assert last[0]["role"] == "system" and chat["policy"] != "" and len(last) == 1 + 2 * n - 1
    for k, t in enumerate(chat["turns"][:-1]):
        assert last[1 + 2 * k] == {"role": "user", "content": t["user"]}
        assert last[2 + 2 * k] == {"role": "assistant", "content": f"reply to: {t['user']}"}


def test_reference_undoes_the_optimisations():
    ref = F.reference_engine_kwargs({"model": "m", "weight_format": "int4", "kv_cache_dtype": "int8",
                                     "speculative_method": "ngram", "policy": "static", "draft_model": "d",
                                     "enable_prefix_caching": True, "max_num_seqs": None})
    assert ref == {"model": "m", "weight_format": "none", "kv_cache_dtype": "auto", "speculative_method": "",
                   "policy": "continuous", "dtype": "float32", "enable_prefix_caching": True}


def test_evaluate_hand_answers():
    qs = [{"id": "a", "policy": "travel_expenses", "kind": "question", "question": "Hotel cap in London?",
           "key_facts": ["230"], "answerable": True},
          {"id": "c/1", "policy": "travel_expenses", "kind": "chat", "question": "Parking at home?", "key_facts": [],
           "answerable": False}]
    ref = [{"id": "a", "text": "€230 per night.", "token_ids": [1, 2, 3]},
           {"id": "c/1", "text": "The policy does not say.", "token_ids": [4, 5]}]
    test = [{"id": "a", "text": "€230 per night.", "token_ids": [1, 2, 3]},
            {"id": "c/1", "text": "It is 20 per day.", "token_ids": [4, 6, 7]}]
    res = F.evaluate(test, qs, ref)
    acc = res["accuracy"]
    assert acc["overall"]["accuracy"] == 0.5 and acc["questions"]["accuracy"] == 1.0
    assert acc["chat_turns"]["accuracy"] == 0.0 and acc["unanswerable"]["accuracy"] == 0.0
    assert res["reference"]["accuracy"]["overall"]["accuracy"] == 1.0
    assert res["agreement"] == 0.5 and res["mean_first_divergence"] == 1
    assert res["gate"]["reference_only"] == 1 and res["gate"]["drop_points"] == 50.0
    assert res["gate"]["verdict"] == G.FAIL
    assert [q["first_divergence"] for q in res["items"]] == [None, 1]
    assert [q["reference_correct"] for q in res["items"]] == [True, True]
    text = F.summary(res)
    assert "FAIL" in text and "chat_turns" in text and "policy travel_expenses" in text


# ---- a real run ---------------------------------------------------------------------------------

@pytest.mark.quality
def test_eval_faithfulness_smollm2_same_config_agrees(smollm2_dir, tmp_path, capsys):
    from kvmesh.cli import main

    out, ref = tmp_path / "f.json", tmp_path / "ref.json"
    # one question and one chat, both on the code of conduct: one ~1.5k-token policy prefill
    argv = ["eval", "faithfulness", "--model", str(smollm2_dir), "--dtype", "float32", "--num-questions", "1",
            "--num-chats", "1", "--max-tokens", "8", "--kv-cache-memory", "128MiB", "--reference", str(ref),
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "key-fact accuracy" in printed and "quality gate" in printed and "chat_turns" in printed
    res = json.loads(out.read_text())
    turns = len(F.select_chats(1)[0]["turns"])
    assert (res["num_questions"], res["num_chat_turns"], res["max_tokens"]) == (1, turns, 8)
    assert {q["id"].split("/")[0] for q in res["items"]} == {"conduct-01", "chat-conduct-1"}
    for group in ("answerable", "overall", "questions", "chat_turns"):
        g = res["accuracy"][group]
        assert 0.0 <= g["ci"][0] <= g["accuracy"] <= g["ci"][1] <= 1.0
    # the same engine twice (reference, then the configuration) gives the same greedy tokens:
    # no discordant pair, and too few items to call it a pass
    assert res["agreement"] == 1.0 and res["num_diverging"] == 0
    g = res["gate"]
    assert g["reference_only"] == g["test_only"] == 0 and g["verdict"] == "NO EVIDENCE"
    assert res["accuracy"] == res["reference"]["accuracy"]
    assert all(0 < len(q["token_ids"]) <= 8 and q["text"] for q in res["items"])
    assert 0.0 <= res["grounding"] <= 1.0
    cached = json.loads(ref.read_text())
    assert [a["token_ids"] for a in cached["answers"]] == [q["token_ids"] for q in res["items"]]
    # a cached reference with other settings is refused, naming the field
    assert main([*argv[:-4], "--max-tokens", "4", "--reference", str(ref)]) == 2
    assert "max_tokens" in capsys.readouterr().err


@pytest.mark.quality
def test_a_broken_configuration_fails_the_gate(smollm2_dir, monkeypatch):
    """A configuration whose logits are corrupted (a test hook: greedy picks the least likely
    token) loses every item the reference answers right: the gate says FAIL."""
    from workers.models.llama import LlamaForCausalLM

    # one policy (a prefill of ~1.5k tokens in float32); smollm2 answers leave-01 right (fp32, greedy)
    items = [it for it in F.select_items(96, 0) if it["id"] in ("leave-01", "leave-02")]
    kw = {"model": str(smollm2_dir), "dtype": "float32", "kv_cache_memory": "128MiB"}
    ref, _ = F.answer_with_llm(kw, items, 24)
    logits = LlamaForCausalLM.compute_logits
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda self, h: -logits(self, h))
    broken, _ = F.answer_with_llm(kw, items, 24)
    res = F.evaluate(broken, items, ref)
    assert res["reference"]["accuracy"]["overall"]["correct"] >= 1, "precondition: the reference answers one right"
    assert res["accuracy"]["overall"]["correct"] == 0 and res["agreement"] == 0.0
    assert res["gate"]["verdict"] == "FAIL" and res["gate"]["reference_only"] >= 1


@pytest.mark.quality
def test_eval_faithfulness_through_a_served_mesh(smollm2_dir, tmp_path, capsys):
    """``--server``: the configuration is the mesh, asked through its gateway (chats turn by
    turn); a float32 mesh answers exactly as the in-process float32 reference."""
    import os

    from bench.served import served
    from kvmesh.cli import main

    env = dict(os.environ, KVMESH_MODEL=str(smollm2_dir), KVMESH_DTYPE="float32", KVMESH_KV_CACHE_MEMORY="128MiB")
    out = tmp_path / "served.json"
    with served(["serve", "--executor", "local", "--port", "0", "--scheduler-port", "0"], env, "gateway") as address:
        argv = ["eval", "faithfulness", "--server", address, "--model", str(smollm2_dir), "--num-questions", "1",
                "--num-chats", "1", "--max-tokens", "8", "--kv-cache-memory", "128MiB", "--out", str(out)]
        assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"] == {"server": address} and res["num_chat_turns"] == len(F.select_chats(1)[0]["turns"])
    assert res["agreement"] == 1.0 and res["gate"]["reference_only"] == res["gate"]["test_only"] == 0
    assert "quality gate" in capsys.readouterr().out
