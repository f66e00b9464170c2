"""What never reaches a file: URL credentials, API keys, secret flag values."""

from stages import secrets


def test_url_credentials_are_stripped_wherever_the_url_is():
    text = "down: http://alice:pw@h:30000/v1 and https://tok@h2/x, ftp://h3/ok"
    assert secrets.strip_url_credentials(text) == \
        "down: http://h:30000/v1 and https://h2/x, ftp://h3/ok"


def test_secret_flags_are_masked_in_both_spellings():
    argv = ["--tp", "8", "--api-key", "sk-1", "--hf-token=hf_2", "--password", "p",
            "--port", "30000", "http://u:p@h:1"]
    assert secrets.redact_args(argv) == ["--tp", "8", "--api-key", "***", "--hf-token=***",
                                         "--password", "***", "--port", "30000", "http://h:1"]


def test_scrub_masks_keys_and_urls_in_nested_values():
    obj = {"a": ["Bearer sk-9\"x", {"url": "http://u:p@h"}], "n": 3, "key": None}
    assert secrets.scrub(obj, ["sk-9\"x", None]) == {"a": ["Bearer ***", {"url": "http://h"}],
                                                     "n": 3, "key": None}
