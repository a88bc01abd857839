"""`python -m hf_hybrid.demo`: the same as `hf-hybrid demo`."""
from . import main

if __name__ == "__main__":
    main()
