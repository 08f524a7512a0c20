"""The toy task generator: determinism, disjoint splits, exact answers."""
import math
import re

import pytest

from rstar2_jax.toy.problems import DEFAULT_KINDS, KINDS, PRINT_CELL, make_splits


def test_same_seed_same_problems_and_different_seed_differs():
    assert make_splits(50, 10, seed=3) == make_splits(50, 10, seed=3)
    assert make_splits(50, 10, seed=3)[0] != make_splits(50, 10, seed=4)[0]


def test_splits_are_disjoint_and_sized():
    train, test = make_splits(2000, 300, seed=0)
    assert (len(train), len(test)) == (2000, 300)
    questions = [p.question for p in train + test]
    assert len(set(questions)) == len(questions)


def test_every_kind_appears():
    train, _ = make_splits(200, 0)
    assert {p.kind for p in train} == set(DEFAULT_KINDS)


def test_kinds_filter_and_validation():
    train, _ = make_splits(20, 0, kinds=["gcd_lcm"])
    assert {p.kind for p in train} == {"gcd_lcm"}
    with pytest.raises(ValueError, match="unknown"):
        make_splits(5, 0, kinds=["calculus"])


def test_code_prints_the_answer():
    """The reference program, run here in-process, prints exactly the answer computed by other means."""
    import contextlib
    import io

    train, _ = make_splits(60, 0, seed=7)
    for p in train:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(p.code, {})
        assert out.getvalue().strip() == p.answer, p


def test_notebook_form_computes_the_answer_from_named_numbers():
    """``compute_cell`` binds the question's numbers and computes ``ans`` from names only;
    ``PRINT_CELL`` run after it in the same namespace prints the answer. mod_inverse's naive
    expression fails where ``naive_code`` does."""
    import contextlib
    import io

    train, _ = make_splits(120, 0, seed=7, kinds=list(KINDS))
    for p in train:
        assert not re.search(r"\d{3,}", p.expression) and set(_numbers(p.question)) <= set(_numbers(p.setup))
        namespace, out = {}, io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(p.compute_cell, namespace)
            assert out.getvalue() == ""
            exec(PRINT_CELL, namespace)
        assert out.getvalue().strip() == p.answer, p
        assert (p.naive_expression is None) == (p.naive_code is None)
        if p.naive_expression:
            with pytest.raises(ValueError, match="not invertible"):
                exec(f"{p.setup}\nans = {p.naive_expression}", {})


def _numbers(question):
    return [int(n) for n in re.findall(r"\d+", question)]


def test_answers_by_independent_brute_force():
    train, _ = make_splits(150, 0, seed=11)
    for p in train:
        n = _numbers(p.question)
        if p.kind == "mod_product":
            expected = (n[0] * n[1]) % n[2]
        elif p.kind == "digit_sum_power":
            expected = sum(int(d) for d in str(pow(n[0], n[1])))
        elif p.kind == "count_primes":
            expected = sum(1 for k in range(n[0], n[1] + 1) if k > 1 and all(k % d for d in range(2, k)))
        elif p.kind == "gcd_lcm":
            expected = math.gcd(n[0], n[1]) + n[2] * n[3] // math.gcd(n[2], n[3])
        else:
            expected = sum(1 for d in range(1, n[0] + 1) if n[0] % d == 0)
        assert p.answer == str(expected), p


def test_estimates_are_usually_wrong():
    train, _ = make_splits(500, 0, seed=2)
    right = sum(p.estimate == p.answer for p in train)
    assert 0 < right < 0.25 * len(train)


def test_mod_inverse_fails_naturally_for_half_and_the_error_says_why():
    """The natural program of a mod_inverse problem without an inverse raises a ValueError that
    says so; the problem's code prints the gcd. Which problems those are does not show in the
    last digits of the numbers."""
    import contextlib
    import io

    train, _ = make_splits(400, 0, seed=5, kinds=["mod_inverse"])
    failing = [p for p in train if p.naive_code]
    assert 0.4 < len(failing) / len(train) < 0.6
    for p in train:
        a, m = _numbers(p.question)
        if p.naive_code:
            assert math.gcd(a, m) > 1 and p.answer == str(math.gcd(a, m))
            with pytest.raises(ValueError, match="not invertible"):
                exec(p.naive_code, {})
        else:
            assert math.gcd(a, m) == 1 and int(p.answer) * a % m == 1
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(p.code, {})
        assert out.getvalue().strip() == p.answer
    # Neither the parity nor the last digit of a tells the two halves apart.
    for ok in (False, True):
        part = [p for p in train if bool(p.naive_code) == ok]
        assert 0.3 < sum(_numbers(p.question)[0] % 2 for p in part) / len(part) < 0.7


def test_default_kinds_leave_mod_inverse_out():
    assert "mod_inverse" in KINDS and "mod_inverse" not in DEFAULT_KINDS
    assert all(p.naive_code is None for p in make_splits(300, 0, seed=1)[0])
