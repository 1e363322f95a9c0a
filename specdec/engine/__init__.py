"""The engine: rows that join and leave, the round, scoring, trees."""
