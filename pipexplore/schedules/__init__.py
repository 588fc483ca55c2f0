"""Schedules: every schedule's order of actions per stage or rank, as torch runs it; CSV files in torch's format.

:mod:`~pipexplore.schedules.names` says what each schedule is (and what torch refuses),
:mod:`~pipexplore.schedules.orders` gives each worker's and rank's order,
:mod:`~pipexplore.schedules.torch_orders` holds the orders of torch's multi-stage schedules, ported,
and :mod:`~pipexplore.schedules.csv_files` reads, checks and writes schedules as CSV files.
The predictor and the executors share this vocabulary; it imports no other part of pipexplore.

Example::

    actions("1f1b", 2, 4)      # [['0F0', '0F1', '0B0', '0F2', ...], ['1F0', '1B0', '1F1', ...]]
"""
from pipexplore.schedules.csv_files import (
                                            COMMS,
                                            COMPUTE,
                                            FORMATS,
                                            CsvSchedule,
                                            is_csv_path,
                                            load_csv,
                                            parse_csv_text,
                                            to_csv_text,
                                            write_csv,
)
from pipexplore.schedules.names import (
                                            MULTI_STAGE,
                                            PHASES,
                                            SCHEDULES,
                                            SPLIT_BACKWARD,
                                            TORCH_CLASSES,
                                            V_SHAPED,
                                            Action,
                                            check_schedule,
                                            checkpointed,
                                            csv_schedule,
                                            is_csv,
                                            is_multi_stage,
                                            is_v_shaped,
                                            known_schedule,
                                            ranks_of,
                                            schedule_version,
                                            splits_backward,
                                            stage_ranks,
)
from pipexplore.schedules.orders import (
                                            actions,
                                            gpipe_order,
                                            interleaved_order,
                                            one_f_one_b_order,
                                            rank_orders,
                                            refusal,
                                            schedule_csv_text,
                                            stage_orders,
                                            worker_devices,
                                            worker_orders,
                                            zero_bubble_h1_order,
)
from pipexplore.schedules.torch_orders import MULTI_STAGE_ORDERS, Order, rounds

__all__ = [
    "SCHEDULES", "MULTI_STAGE", "V_SHAPED", "SPLIT_BACKWARD", "TORCH_CLASSES", "PHASES", "Action", "Order",
    "check_schedule",
    "stage_ranks", "ranks_of", "is_csv", "csv_schedule", "schedule_version", "known_schedule", "is_multi_stage",
    "splits_backward", "is_v_shaped", "checkpointed", "actions", "rank_orders", "worker_orders", "refusal",
    "stage_orders", "interleaved_order", "worker_devices", "gpipe_order", "one_f_one_b_order",
    "zero_bubble_h1_order", "schedule_csv_text", "MULTI_STAGE_ORDERS", "rounds", "CsvSchedule", "load_csv",
    "parse_csv_text", "to_csv_text", "write_csv", "is_csv_path", "FORMATS", "COMPUTE", "COMMS"
]

