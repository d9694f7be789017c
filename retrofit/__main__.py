"""``python -m retrofit ...`` (and ``torchrun -m retrofit ...``): the whole ``retrofit`` command line."""
from retrofit._entry import main

if __name__ == "__main__":
    main()
