"""``kvmesh eval faithfulness`` (bench/faithfulness.py): the scorer's rules on hand examples, and
one real run with smollm2 where the configuration equals the reference."""

from __future__ import annotations

import json

import pytest

from bench import faithfulness as F
from bench import policydesk


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
    assert F.contains_fact(answer, fact)


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
    assert not F.contains_fact(answer, fact)


def test_key_facts_need_all_of_them():
    assert F.key_facts_correct("Head of Department and the CFO", ["Head of Department", "CFO"])
    assert not F.key_facts_correct("Only the CFO", ["Head of Department", "CFO"])
    assert F.normalize("€1,500 — 09:30\u00a0am") == "1500 - 9:30 am"


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
    assert F.abstains(answer)
    assert F.unanswerable_correct(answer, "Is there a parking allowance?")


@pytest.mark.parametrize("answer", [
    "Yes, you get a parking allowance.",
    "The allowance is 50 per month.",
    "The policy does not say, but it is usually 50 per month.",     # abstains, then invents a figure
    "",
])
def test_made_up_answers_are_wrong(answer):
    assert not F.unanswerable_correct(answer, "Is there a parking allowance?")


def test_numbers_from_the_question_are_not_made_up():
    q = "Can I work from abroad for 30 days?"
    assert F.unanswerable_correct("The policy does not say whether 30 days abroad are allowed.", q)
    assert F.new_numbers("It says 45 days, not 30 days.", q) == ["45"]


def test_is_correct_dispatches_on_answerable():
    ans = {"question": "Hotel cap in London?", "key_facts": ["230"], "answerable": True}
    una = {"question": "Parking?", "key_facts": [], "answerable": False}
    assert F.is_correct("€230 per night", ans) and not F.is_correct("The policy does not say.", ans)
    assert F.is_correct("The policy does not say.", una) and not F.is_correct("€230 per night", una)


# ---- grounding, agreement, accuracy, gate -------------------------------------------------------

def test_grounding_hand_example():
    source = "Hotels in London are capped at 230 euros per night."
    # content words: hotel(s) -> "hotel" not a word of the source, "london", "230", "night", "pizza"
    assert F.content_words("The hotel in London: 230 per night, with pizza!") == ["hotel", "london", "230", "night", "pizza"]
    assert F.grounding("The hotel in London: 230 per night, with pizza!", source) == pytest.approx(3 / 5)
    assert F.grounding("It is the one.", source) is None                  # only stop words
    text = policydesk.system_message("travel_expenses")
    assert F.grounding("The policy does not say.", text) == 1.0           # system prompt words count


def test_first_divergence_and_agreement():
    assert F.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert F.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert F.first_divergence([1, 2], [1, 2, 3, 4]) == 2                  # a prefix: the shorter's length
    assert F.first_divergence([], [7]) == 0
    ag = F.agreement([[1, 2, 3], [4, 5], [6], [1, 2]], [[1, 2, 3], [4, 9], [7], [1, 2, 3]])
    assert ag == {"agreement": 0.25, "num_diverging": 3, "mean_first_divergence": (1 + 0 + 2) / 3}
    assert F.agreement([[1]], [[1]])["mean_first_divergence"] is None
    with pytest.raises(ValueError):
        F.agreement([[1]], [])


def test_accuracy_groups():
    acc = F.accuracy([True, False, True, True], [True, True, False, True])
    assert acc == {"answerable": 2 / 3, "unanswerable": 1.0, "overall": 0.75}
    assert F.accuracy([True], [True])["unanswerable"] is None


def test_gate_at_exactly_two_points():
    assert F.accuracy_drop_points(0.48, 0.50) == 2.0
    assert F.passes_gate(0.48, 0.50)                     # exactly 2 points: passes
    assert not F.passes_gate(0.4799, 0.50)               # 2.01 points: fails
    assert F.passes_gate(0.60, 0.50)                     # better than the reference
    assert not F.passes_gate(0.9375, 1.0)                # one question of 16 lost


def test_select_questions_interleaves_policies_and_unanswerables():
    qs = F.select_questions(12)
    assert [q["answerable"] for q in qs].count(False) == 2 and not qs[2]["answerable"]
    assert len({q["policy"] for q in qs}) == 8
    assert len({q["id"] for q in F.select_questions(96)}) == 96
    with pytest.raises(ValueError, match="num_questions"):
        F.select_questions(0)


def test_reference_undoes_the_optimisations():
    ref = F.reference_engine_kwargs({"model": "m", "weight_format": "int4", "kv_cache_dtype": "int8",
                                     "speculative_method": "ngram", "policy": "static", "draft_model": "d",
                                     "enable_prefix_caching": True, "max_num_seqs": None})
    assert ref == {"model": "m", "weight_format": "none", "kv_cache_dtype": "auto", "speculative_method": "",
                   "policy": "continuous", "dtype": "float32", "enable_prefix_caching": True}


def test_evaluate_hand_answers():
    qs = [{"id": "a", "policy": "travel_expenses", "question": "Hotel cap in London?", "key_facts": ["230"],
           "answerable": True},
          {"id": "b", "policy": "travel_expenses", "question": "Parking at home?", "key_facts": [],
           "answerable": False}]
    ref = [{"id": "a", "text": "€230 per night.", "token_ids": [1, 2, 3]},
           {"id": "b", "text": "The policy does not say.", "token_ids": [4, 5]}]
    test = [{"id": "a", "text": "€230 per night.", "token_ids": [1, 2, 3]},
            {"id": "b", "text": "It is 20 per day.", "token_ids": [4, 6, 7]}]
    res = F.evaluate(test, qs, ref)
    assert res["accuracy"] == {"answerable": 1.0, "unanswerable": 0.0, "overall": 0.5}
    assert res["reference"]["accuracy"]["overall"] == 1.0
    assert res["agreement"] == 0.5 and res["mean_first_divergence"] == 1
    assert res["accuracy_drop_points"] == 50.0 and res["passes_gate"] is False
    assert [q["first_divergence"] for q in res["questions"]] == [None, 1]
    assert "FAIL" in F.summary(res)


# ---- a real run ---------------------------------------------------------------------------------

def test_eval_faithfulness_smollm2_same_config_agrees(smollm2_dir, tmp_path, capsys):
    from kvmesh.cli import main

    out, ref = tmp_path / "f.json", tmp_path / "ref.json"
    argv = ["eval", "faithfulness", "--model", str(smollm2_dir), "--dtype", "float32", "--num-questions", "3",
            "--max-tokens", "8", "--kv-cache-memory", "128MiB", "--reference", str(ref), "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "key-fact accuracy" in printed and "quality gate" in printed
    res = json.loads(out.read_text())
    assert res["num_questions"] == 3 and res["max_tokens"] == 8
    for group in ("answerable", "unanswerable", "overall"):
        assert 0.0 <= res["accuracy"][group] <= 1.0
    # the same engine twice (reference, then the configuration) gives the same greedy tokens
    assert res["agreement"] == 1.0 and res["num_diverging"] == 0 and res["passes_gate"] is True
    assert res["accuracy"] == res["reference"]["accuracy"]
    assert all(0 < len(q["token_ids"]) <= 8 and q["text"] for q in res["questions"])
    assert 0.0 <= res["grounding"] <= 1.0
    cached = json.loads(ref.read_text())
    assert [a["token_ids"] for a in cached["answers"]] == [q["token_ids"] for q in res["questions"]]
    # a cached reference with other settings is refused, naming the field
    assert main([*argv[:-4], "--max-tokens", "4", "--reference", str(ref)]) == 2
    assert "max_tokens" in capsys.readouterr().err
