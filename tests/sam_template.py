"""template.yaml as SAM translates it and CloudFormation deploys it, offline, for the tests
of the stack (tests/test_template*.py) and of the built package (tests/test_build.py,
tests/test_lambda_runtime.py): the template loaded and translated (with CodeUri as `sam
package` writes it), its parameters and conditions resolved as CloudFormation resolves
them (`deployed`), and the Makefile run as `sam build` runs it (`make`, with this
machine's Python 3.12 when there is one)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import boto3
from cfnlint.decode import decode
from samtranslator.parser import parser as sam_parser
from samtranslator.translator.translator import Translator

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "template.yaml"
MAKEFILE = REPO / "Makefile"

FUNCTIONS = {
    "ApiFunction": "handler.api",
    "MigrationFunction": "handler.migrate",
    "ReportFunction": "handler.report",
}
ANALYSER_ROUTES = {
    "GET /ping",
    "GET /queue",
    "POST /uploadAnalysis",
    "POST /reportAnalysisFailure",
}
REQUIRED_PARAMETERS = {
    "DbHost": "x.example.internal",
    "DbName": "analysis",
    "DbSecretArn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:db-AbCdEf",
    "SubnetIds": "subnet-0123456789abcdef0",
    "SecurityGroupIds": "sg-0123456789abcdef0",
    "UploadPasswordSecretArn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:up-AbCdEf",
    "AdminTokenParameterName": "/analysis-queue/admin-token",
}
NO_VALUE = object()


def load_template() -> dict:
    template, matches = decode(str(TEMPLATE))
    assert not matches, [str(m) for m in matches]
    return json.loads(json.dumps(template))  # plain dicts, no cfn-lint node types


def translate(
    code_uri: str = "s3://bucket/0123456789abcdef", parameters: dict | None = None
) -> dict:
    """Run the SAM transform offline, with CodeUri as `sam package` would rewrite it."""
    template = load_template()
    template["Globals"]["Function"]["CodeUri"] = code_uri
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::Serverless::Function":
            resource["Properties"].pop("CodeUri", None)
        if resource["Type"] == "AWS::Serverless::LayerVersion":
            resource["Properties"]["ContentUri"] = "s3://bucket/layer-0123456789abcdef"
    translator = Translator(
        managed_policy_map={},
        sam_parser=sam_parser.Parser(),
        boto_session=boto3.session.Session(region_name="us-east-1"),
    )
    return translator.translate(sam_template=template, parameter_values=dict(parameters or {}))


def resources_of_type(template: dict, resource_type: str) -> dict:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == resource_type}


def sam_dir_checksum(directory: Path) -> str:
    """The hash `sam deploy` names a directory's zip by (samcli.lib.utils.hash.dir_checksum):
    md5 over the sorted relative paths and each file's md5. File times and modes do not count."""
    digest = hashlib.md5(usedforsecurity=False)
    files = sorted(str(p) for p in directory.rglob("*") if p.is_file())
    for name in files:
        digest.update(os.path.relpath(name, directory).encode())
        digest.update(
            hashlib.md5(Path(name).read_bytes(), usedforsecurity=False).hexdigest().encode()
        )
    return digest.hexdigest()


def find_lambda_python() -> str | None:
    """A Python 3.12 (the Lambda runtime's version) on this machine, if there is one."""
    candidates = [shutil.which("python3.12"), "/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"],
                capture_output=True,
                check=False,
            )
            if probe.returncode == 0:
                return candidate
    return None


LAMBDA_PYTHON = find_lambda_python()


def make(target: str, cwd: Path, artifacts: Path, **variables: str) -> subprocess.CompletedProcess:
    """Run a Makefile target the way SAM's CustomMakeBuilder does: in a copy of the source,
    with the repository's Makefile and ARTIFACTS_DIR in the environment. The bytecode is
    compiled by this machine's Python 3.12 (none: the package ships without it, and
    tests/test_bytecode.py fails saying so)."""
    if LAMBDA_PYTHON:
        variables.setdefault("LAMBDA_PYTHON", LAMBDA_PYTHON)
    else:
        variables.setdefault("ALLOW_NO_BYTECODE", "1")
    env = {**os.environ, "ARTIFACTS_DIR": str(artifacts)}
    args = ["make", "--no-print-directory", "--makefile", str(MAKEFILE), target]
    args += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def resolve(template: dict, overrides: dict | None = None) -> dict:
    """The translated template's resources with parameters and conditions applied the
    way CloudFormation applies them (Ref to a parameter, Fn::If, Fn::Equals, Fn::Not,
    Fn::And, Fn::Or, Fn::Join; resources whose Condition is false are dropped)."""
    params = {}
    for name, spec in template["Parameters"].items():
        raw = {**REQUIRED_PARAMETERS, **(overrides or {})}.get(name, spec.get("Default"))
        if spec["Type"] in ("CommaDelimitedList", "List<AWS::EC2::Subnet::Id>") or spec[
            "Type"
        ].startswith("List<"):
            raw = [] if raw in (None, "") else str(raw).split(",")
        params[name] = raw
    conditions: dict[str, bool] = {}

    def condition(name: str) -> bool:
        if name not in conditions:
            conditions[name] = bool(value(template["Conditions"][name]))
        return conditions[name]

    def value(node):
        if isinstance(node, dict) and len(node) == 1:
            ((key, arg),) = node.items()
            if key == "Ref":
                if arg == "AWS::NoValue":
                    return NO_VALUE
                return params.get(arg, node)
            if key == "Fn::If":
                name, yes, no = arg
                return value(yes if condition(name) else no)
            if key == "Fn::Equals":
                return value(arg[0]) == value(arg[1])
            if key == "Fn::Not":
                return not value(arg[0])
            if key == "Fn::And":
                return all(value(a) for a in arg)
            if key == "Fn::Or":
                return any(value(a) for a in arg)
            if key == "Condition":
                return condition(arg)
            if key == "Fn::Join":
                items = value(arg[1])
                return arg[0].join(items if items != [] else [""])
        if isinstance(node, dict):
            out = {k: value(v) for k, v in node.items()}
            return {k: v for k, v in out.items() if v is not NO_VALUE}
        if isinstance(node, list):
            return [v for v in (value(x) for x in node) if v is not NO_VALUE]
        return node

    resources = {
        name: value(resource)
        for name, resource in template["Resources"].items()
        if "Condition" not in resource or condition(resource["Condition"])
    }
    return {"Resources": resources, "Outputs": value(template.get("Outputs", {}))}


def deployed(transformed: dict, **overrides: str) -> dict:
    return resolve(transformed, overrides)["Resources"]
