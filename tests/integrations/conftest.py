import sys
from pathlib import Path

# ds_plan_factory.py (hand-made Plans) is imported by name from the tests here.
sys.path.insert(0, str(Path(__file__).parent))
