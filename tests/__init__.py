"""Test suite for flatview (a package so that worker tasks pickle by reference)."""
