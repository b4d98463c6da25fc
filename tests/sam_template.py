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
import re
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
# What a stack with the defaults is given: no value without a default (DbResourceId has an
# empty one, which IamAuthNeedsTheResourceId refuses with DbAuth iam, the default).
REQUIRED_PARAMETERS = {
    "DbHost": "x.example.internal",
    "DbName": "analysis",
    "DbResourceId": "db-ABCDEFGHIJKLMNOPQRSTUVWXY0",
    "SubnetIds": "subnet-0123456789abcdef0",
    "SecurityGroupIds": "sg-0123456789abcdef0",
}
# The database's password in Secrets Manager (DbAuth secret), and the shared password and
# admin token imported from a secret and a parameter: every store the stack can read.
SECRET_PARAMETERS = {
    "DbAuth": "secret",
    "DbSecretArn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:db-AbCdEf",
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


def parameter_values(template: dict, overrides: dict | None = None) -> dict:
    """Each parameter's value as CloudFormation passes it: REQUIRED_PARAMETERS and
    `overrides` over the defaults, lists split at commas."""
    params = {}
    for name, spec in template["Parameters"].items():
        raw = {**REQUIRED_PARAMETERS, **(overrides or {})}.get(name, spec.get("Default"))
        if spec["Type"] in ("CommaDelimitedList", "List<AWS::EC2::Subnet::Id>") or spec[
            "Type"
        ].startswith("List<"):
            raw = [] if raw in (None, "") else str(raw).split(",")
        params[name] = raw
    return params


def broken_rules(template: dict, overrides: dict | None = None) -> list[str]:
    """The Rules whose assertions fail for these parameter values (CloudFormation then
    refuses the stack before it changes anything): Ref, Fn::Equals, Fn::Not, Fn::And,
    Fn::Or and Fn::EachMemberEquals, the functions the template's rules use."""
    params = parameter_values(template, overrides)

    def value(node):
        ((key, arg),) = node.items()
        if key == "Ref":
            return params[arg]
        if key == "Fn::Equals":
            return value_of(arg[0]) == value_of(arg[1])
        if key == "Fn::Not":
            return not value(arg[0])
        if key == "Fn::And":
            return all(value(a) for a in arg)
        if key == "Fn::Or":
            return any(value(a) for a in arg)
        if key == "Fn::EachMemberEquals":
            return all(member == arg[1] for member in value(arg[0]))
        raise AssertionError(f"not evaluated here: {key}")

    def value_of(node):
        return value(node) if isinstance(node, dict) else node

    broken = []
    for name, rule in template.get("Rules", {}).items():
        if "RuleCondition" in rule and not value(rule["RuleCondition"]):
            continue
        if not all(value(a["Assert"]) for a in rule["Assertions"]):
            broken.append(name)
    return broken


def resolve(template: dict, overrides: dict | None = None) -> dict:
    """The translated template's resources with parameters and conditions applied the
    way CloudFormation applies them (Ref to a parameter, Fn::If, Fn::Equals, Fn::Not,
    Fn::And, Fn::Or, Fn::Join; Fn::Sub's parameters, the rest of it left as it is;
    resources and outputs whose Condition is false are dropped)."""
    params = parameter_values(template, overrides)
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
            if key == "Fn::Sub" and isinstance(arg, str):
                text = re.sub(
                    r"\$\{([^}!]+)\}",
                    lambda m: (
                        str(params[m[1]])
                        if isinstance(params.get(m[1]), str | int | float)
                        else m[0]
                    ),
                    arg,
                )
                return text if "${" not in text else {"Fn::Sub": text}
        if isinstance(node, dict):
            out = {k: value(v) for k, v in node.items()}
            return {k: v for k, v in out.items() if v is not NO_VALUE}
        if isinstance(node, list):
            return [v for v in (value(x) for x in node) if v is not NO_VALUE]
        return node

    def present(items: dict) -> dict:
        return {
            name: value(item)
            for name, item in items.items()
            if "Condition" not in item or condition(item["Condition"])
        }

    outputs = present(template.get("Outputs", {}))
    return {"Resources": present(template["Resources"]), "Outputs": outputs}


def deployed(transformed: dict, **overrides: str) -> dict:
    return resolve(transformed, overrides)["Resources"]
