"""m2r2-chat: the terminal chat that shows each token's exit depth."""
