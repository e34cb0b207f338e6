"""hack/local-cluster/matrix.py: what the table makes of the tier's JUnit XML (a case's
failure, a teardown error after a pass, a release that lacks the feature) and which
releases `--releases` names."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("matrix_under_test", REPO / "hack" / "local-cluster" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = matrix  # its dataclasses look their module up
_spec.loader.exec_module(matrix)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
 <testcase classname="tests.cluster.test_a" name="test_passes" time="1"/>
 <testcase classname="tests.cluster.test_a" name="test_fails" time="1">
  <failure message="AssertionError: the pod did not run&#10;second line">trace</failure></testcase>
 <testcase classname="tests.cluster.test_a" name="test_torn_down" time="1"/>
 <testcase classname="tests.cluster.test_a" name="test_torn_down" time="1">
  <error message="failed on teardown with &quot;oops&quot;">trace</error></testcase>
 <testcase classname="tests.cluster.test_b" name="test_old" time="0">
  <skipped type="pytest.skip" message="Skipped: not applicable on 1.32: taints (Kubernetes 1.33+)">x</skipped></testcase>
 <testcase classname="tests.cluster.test_b" name="test_no_gpu" time="0">
  <skipped type="pytest.skip" message="needs a GPU">x</skipped></testcase>
 <testcase classname="tests.cluster.test_b" name="test_silent" time="0"><failure>trace</failure></testcase>
</testsuite></testsuites>
"""


def test_each_case_of_the_junit_is_passed_failed_or_not_applicable_with_its_reason(tmp_path):
    path = tmp_path / "v1.32.13.xml"
    path.write_text(JUNIT)
    cases = matrix.parse_junit(path)
    assert {k: (v.result, v.reason) for k, v in cases.items()} == {
        "test_a::test_passes": ("passed", ""),
        "test_a::test_fails": ("failed", "AssertionError: the pod did not run"),
        "test_a::test_torn_down": ("failed", 'failed on teardown with "oops"'),
        "test_b::test_old": ("n/a", "not applicable on 1.32: taints (Kubernetes 1.33+)"),
        "test_b::test_no_gpu": ("skipped", "needs a GPU"),
        "test_b::test_silent": ("failed", ""),
    }


def test_releases_are_picked_by_minor_or_version_and_an_unknown_one_is_one_line():
    releases = ["v1.32.13", "v1.33.13", "v1.37.2"]
    assert matrix.pick(releases, "1.37, 1.32") == ["v1.37.2", "v1.32.13"]
    assert matrix.pick(releases, "v1.33.13") == ["v1.33.13"]
    assert matrix.pick(releases, None) == releases
    with pytest.raises(SystemExit, match=r"--releases: 1.31 is not one of v1.32.13, v1.33.13, v1.37.2"):
        matrix.pick(releases, "1.31")


def test_a_rerun_of_the_failed_cases_replaces_their_outcomes_and_says_so(tmp_path):
    (tmp_path / "v1.35.4.xml").write_text(JUNIT)
    rerun = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
     <testcase classname="tests.cluster.test_a" name="test_fails" time="1"/>
     <testcase classname="tests.cluster.test_b" name="test_silent" time="0"><failure message="again">t</failure></testcase>
    </testsuite></testsuites>"""
    (tmp_path / "v1.35.4.rerun-1.xml").write_text(rerun)
    cases = matrix.outcomes(tmp_path, "v1.35.4")
    assert cases["test_a::test_fails"] == matrix.Outcome("passed", "", rerun=True)
    assert cases["test_b::test_silent"] == matrix.Outcome("failed", "again", rerun=True)
    assert cases["test_a::test_torn_down"].result == "failed" and not cases["test_a::test_torn_down"].rerun
    run = matrix.ReleaseRun("v1.35.4", 60.0, cases=cases)
    text = matrix.table([run], markdown=True)
    assert "| `test_a::test_fails` | passed (rerun) |" in text
    assert "| `test_b::test_silent` | FAILED (rerun) [" in text
    # a later rerun goes over the earlier one (rerun-10 after rerun-2: numbers, not text)
    (tmp_path / "v1.35.4.rerun-2.xml").write_text(rerun.replace('message="again"', 'message="twice"'))
    (tmp_path / "v1.35.4.rerun-10.xml").write_text(rerun.replace('<failure message="again">t</failure>', ""))
    assert matrix.outcomes(tmp_path, "v1.35.4")["test_b::test_silent"].result == "passed"


def test_a_table_row_names_the_case_as_pytest_does():
    assert (matrix.node_id("test_extended_resources::test_x[deviceclass.resource.kubernetes.io/gpu-1-None]")
            == "tests/cluster/test_extended_resources.py::test_x[deviceclass.resource.kubernetes.io/gpu-1-None]")
