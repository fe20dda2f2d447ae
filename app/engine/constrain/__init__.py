"""Constrained decoding: what a constrained request must generate (its Lark grammar) and the
llguidance matchers applied per sequence inside the batch."""
