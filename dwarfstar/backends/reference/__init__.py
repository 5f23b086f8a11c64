"""Torch CPU reference: the numerical oracle every other backend is checked against."""
