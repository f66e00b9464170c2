"""What several test modules share: servers, stage runners, scratch repos and sets.

Tests import from here, never from another `test_*.py` (tests/test_layout.py holds it).
"""
