import os
import sys

# Tests run from a source checkout without `pip install -e plugins/lmdb_buffer` too.
PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PLUGIN_ROOT not in sys.path:
    sys.path.insert(0, PLUGIN_ROOT)
