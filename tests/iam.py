"""Acting as an IAM user holding one policy, in moto with IAM enforced (inside `mock_aws`): how the tests
check that a generated role's statements allow what the runtime does, and refuse the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest


def act_as_a_user_holding(policy: dict[str, Any], monkeypatch: pytest.MonkeyPatch, name: str = "function") -> None:
    """Create a user with `policy` (three requests) and an access key (one), and make its credentials boto3's
    from now on."""
    import boto3

    iam = boto3.client("iam")
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="policy", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    boto3.setup_default_session()  # the user's credentials from now on
