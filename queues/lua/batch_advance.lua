--[[ batch_advance: move a batch to its next status, only from the statuses that lead there.
KEYS: batch hash
ARGV: batch id, statuses it may leave (space separated), the new status, the timestamp field
  to set ('' for none), now (s)
Returns the status after the call (a BatchStatus): the new one, or the unchanged one when it
was not allowed (e.g. cancel on a completed batch; in_progress -> finalizing after a cancel
arrived).
Errors: NOT_FOUND (no such batch: queues/batches.py raises BatchNotFound).
The set of active batches is not touched here: it is global, in another Cluster slot than the
batch's own keys. BatchStore.advance drops a batch that ended from it afterwards; a process that
dies in between leaves an ended batch there, which the sweep drops (it skips ended batches). ]]
local batch = KEYS[1]
local id, from_statuses, to, stamp, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local status = redis.call('HGET', batch, 'status')
if not status then
  return redis.error_reply('NOT_FOUND')
end
for allowed in string.gmatch(from_statuses, '%S+') do
  if allowed == status then
    redis.call('HSET', batch, 'status', to)
    if stamp ~= '' then
      redis.call('HSET', batch, stamp, now)
    end
    return to
  end
end
return status
