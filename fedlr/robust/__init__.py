"""Robust aggregation in a method's update space: the rules (rules.py), the
update spaces (spaces.py) and the update-size screen (screen.py).
"""
