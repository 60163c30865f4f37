"""`qbuild run --junit-xml FILE`: quality gates and failed steps as JUnit test cases for CI systems.

One test suite per recipe. Each variant with gates is a test case (a failure when a bound is missed,
with the value, the bound and by how much); each failed step is an errored test case naming its log;
each skipped step a skipped one. Written with junitparser in the layout of the JUnit schema Jenkins'
xUnit reads (junit-10.xsd; GitLab and GitHub Actions read it too): a test validates against it.
"""

from __future__ import annotations

import os
from pathlib import Path


def junit_xml(summaries: list[dict]):
    from junitparser import Error, Failure, JUnitXml, Skipped, TestCase, TestSuite

    report = JUnitXml("qbuild")
    for s in summaries:
        suite = TestSuite(f"qbuild.{s['recipe']}")
        suite.add_property("run_id", str(s.get("run_id")))  # properties first: the schema's order
        suite.add_property("store", str(s.get("store")))
        checks = (s.get("gates") or {}).get("checks", [])
        for variant in dict.fromkeys(c["variant"] for c in checks):
            mine = [c for c in checks if c["variant"] == variant]
            case = TestCase(f"gates[{variant}]", classname=f"qbuild.{s['recipe']}.gates")
            failed = [c for c in mine if not c["passed"]]
            if failed:
                case.result = [Failure("; ".join(_line(c) for c in failed), type_="quality gate")]
            case.system_out = "\n".join(_line(c) for c in mine)
            suite.add_testcase(case)
        for step in s.get("steps", []):
            if step["status"] == "failed":
                case = TestCase(step["name"], classname=f"qbuild.{s['recipe']}.steps", time=step.get("seconds") or 0)
                case.result = [Error(str(step.get("error")), type_="step failed")]
                case.system_out = f"log: {step.get('log')}"
                suite.add_testcase(case)
            elif step["status"] == "skipped":
                case = TestCase(step["name"], classname=f"qbuild.{s['recipe']}.steps")
                case.result = [Skipped(str(step.get("error")))]
                suite.add_testcase(case)
        report.add_testsuite(suite)
    return report


def _line(check: dict) -> str:
    value = check.get("note") or ("not measured" if check["value"] is None else f"{check['value']:.6g}")
    verdict = "pass" if check["passed"] else "FAIL" + (f" (off by {check['by']:.4g})" if check.get("by") else "")
    return f"{check['check']}: {value} vs bound {check['bound']:.6g}: {verdict}"


def write_junit(path: str | os.PathLike, summaries: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    junit_xml(summaries).write(str(tmp), pretty=True)
    os.replace(tmp, path)
    return path
