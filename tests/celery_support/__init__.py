"""Helpers of ``tests/test_celery.py``: real Celery worker processes."""
